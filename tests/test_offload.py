"""The colocated memory handoff (megarl/actor/offload.py) on real Megatron TrainStates and the real
vLLM engine, on CPU where the same code really frees and restores memory.

One launch per layout does all the work (tests/workers/offload_handoff.py); these tests read what
every rank saved. Offload must free exactly the storages it claims (sizes 0) and count exactly the
bytes that the buffer sizes predict; reload must restore every parameter, main param and Adam
moment bit for bit; a second update after offload/reload must equal a run that never offloaded;
around vLLM (offload.device_to_engine) the order must be: optimizer state and gradients off, the
engine's weights woken, the sync, the parameters off, the KV cache woken, generate, release_memory,
reload. tests/test_memory_order.py checks the same order inside a real training step.
With Megatron's optimizer offload (a bf16 model, half its optimizer state stepped on the host) the
handoff moves and counts only the device-resident half: the host half keeps its storages and
values throughout.
"""

import json

import pytest
import torch

from tests.launch import finish, start

FP32 = 4  # bytes per element of the Adam moments, fp32 main params and fp32 gradients
# layout -> (nproc, ParallelDims fields,
#            {case: (model, dtype or None, distributed optimizer, optimizer_offload.fraction)})
LAYOUTS = {
    "single": (1, {}, {"dense": ("qwen3", None, True, 0.0), "dense_bf16": ("qwen3", "bfloat16", True, 0.0),
                       "dense_plain_optimizer": ("qwen3", None, False, 0.0),
                       "dense_bf16_optimizer_offload": ("qwen3", "bfloat16", True, 0.5)}),
    "ep2": (2, {"ep": 2}, {"moe": ("qwen3_moe", None, True, 0.0),
                           "moe_bf16": ("qwen3_moe", "bfloat16", True, 0.0)}),
}
OPTIMIZER_OFFLOAD = [(layout, case) for layout, (_, _, cases) in LAYOUTS.items()
                     for case, spec in cases.items() if spec[3]]
CASES = [(layout, case) for layout, (_, _, cases) in LAYOUTS.items() for case in cases]


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory):
    """{layout: {case: [result of each rank]}}; the single-rank launch also runs the vLLM handoff.
    The launches run at once (the one-rank launch would leave a core idle)."""
    folders, launches = {}, []
    for layout, (nproc, dims, cases) in LAYOUTS.items():
        folders[layout] = tmp_path_factory.mktemp(f"offload_{layout}")
        spec = [[case, hf_models[model], dtype, dist_opt, fraction]
                for case, (model, dtype, dist_opt, fraction) in cases.items()]
        vllm = ["--vllm", hf_models["qwen3"]] if layout == "single" else []
        launches.append(start("tests/workers/offload_handoff.py", "--layout", json.dumps(dims), "--cases",
                              json.dumps(spec), "--out-dir", str(folders[layout]), *vllm, nproc=nproc,
                              timeout=900))
    finish(*launches)
    out = {}
    for layout, (nproc, _, cases) in LAYOUTS.items():
        names = list(cases) + (["handoff"] if layout == "single" else [])
        out[layout] = {name: [torch.load(folders[layout] / f"{name}_rank{r}.pt") for r in range(nproc)]
                       for name in names}
    return out


def expected_bytes(counts: dict, params: bool) -> tuple:
    """(host bytes, device bytes freed) predicted from the buffer and optimizer sizes: the
    device-resident Adam moments always; bf16 models' separate device-resident fp32 main params
    always (fp32 models' main params are views of the parameters); the parameter buffers when
    `params`; gradients freed, not copied. What Megatron's optimizer offload keeps on the host:
    neither."""
    separate_main = counts["param_dtype"] != "torch.float32"
    host = (FP32 * counts["moment_numel"] + separate_main * FP32 * counts["main_numel"]
            + params * counts["param_bytes"])
    return host, host + counts["grad_bytes"]


@pytest.mark.parametrize("params", [False, True])
@pytest.mark.parametrize("layout,case", CASES)
def test_offload_frees_what_it_counts(results, layout, case, params):
    for rank, result in enumerate(results[layout][case]):
        counts, got = result["counts"], result["offloads"][params]
        bf16 = counts["param_dtype"] == "torch.bfloat16"
        assert counts["moment_numel"] == 2 * counts["main_numel"] > 0  # exp_avg + exp_avg_sq
        host = {"host": False} if counts["host_bytes"] else {}  # never freed
        assert got["freed"] == {"moments": True, "grads": True, "params": params,
                                "main": params or bf16, **host}, (rank, got["freed"])
        assert (got["host_bytes"], got["freed_bytes"]) == expected_bytes(counts, params), rank
        assert got["after_reload"] == dict.fromkeys(got["freed"], False), rank
        if layout == "ep2":
            assert counts["expert_buffers"] == 1  # expert-parallel buffers were covered too


@pytest.mark.parametrize("layout,case", OPTIMIZER_OFFLOAD)
def test_optimizer_state_on_the_host_is_neither_copied_nor_counted(results, layout, case):
    """Half the optimizer's elements (Megatron's split: whole parameters in order until half is
    reached) are stepped on the host: their fp32 copies, moments and pinned gradients (16 bytes an
    element) stay in their storages with their values, before,
    during and after the handoff, and only the device half is copied and counted (the byte
    counts themselves: test_offload_frees_what_it_counts)."""
    for rank, result in enumerate(results[layout][case]):
        counts = result["counts"]
        host, device = counts["host_main_numel"], counts["main_numel"]
        assert device > 0 and 0.5 <= host / (host + device) < 0.75, (rank, host, device)
        assert counts["host_bytes"] == 4 * FP32 * counts["host_main_numel"], rank
        for params, got in result["offloads"].items():
            assert got["host_resident"] == {"during": {"same_storages": True, "same_values": True},
                                            "after": {"same_storages": True, "same_values": True}}, params
            copied = FP32 * (counts["moment_numel"] + counts["main_numel"]) + params * counts["param_bytes"]
            assert got["host_bytes"] == copied, (rank, params)


@pytest.mark.parametrize("params", [False, True])
@pytest.mark.parametrize("layout,case", CASES)
def test_reload_restores_bit_for_bit(results, layout, case, params):
    for result in results[layout][case]:
        got = result["offloads"][params]
        assert got["difference"] is None  # the first parameter/main param/moment that differed
        assert got["grads_zero"]


@pytest.mark.parametrize("layout,case", CASES)
def test_next_update_equals_a_run_that_never_offloaded(results, layout, case):
    for result in results[layout][case]:
        assert result["first_update_difference"] is None  # the two runs agree before offloading
        assert result["second_update_moved"] is not None  # the second update changed weights...
        assert result["second_update_difference"] is None  # ...identically, moments intact


def test_handoff_order_around_vllm(results):
    """Spy records (call, actor moments freed, actor parameters freed at that moment); actor and
    critic both move, the actor's parameters only after the sync has read them."""
    result = results["single"]["handoff"][0]
    assert result["calls"] == [("offload", False, False), ("offload", True, False),
                               ("resume_memory", True, False), ("sync", True, False),
                               ("offload", True, False), ("resume_memory", True, True),
                               ("generate", True, True), ("release_memory", True, True),
                               ("reload", True, True), ("reload", True, False), ("reload", True, False)]
    everything = {"moments": True, "grads": True, "params": True, "main": True}
    assert result["inside"] == {"actor": everything, "critic": everything}
    assert result["tokens_equal"], result["tokens"]  # vLLM generated with the synced weights
    assert result["after"] == [dict.fromkeys(everything, False)] * 2
    assert result["differences"] == [None, None]
    assert result["freed_bytes"] == sum(expected_bytes(c, params=True)[1] for c in result["counts"])


def test_handoff_is_undone_when_generation_raises(results):
    result = results["single"]["handoff"][0]
    assert result["raised_calls"] == [("offload", False, False), ("offload", True, False),
                                      ("resume_memory", True, False), ("sync", True, False),
                                      ("resume_memory", True, False), ("release_memory", True, False),
                                      ("reload", True, False), ("reload", True, False)]
    assert result["raised_after"] == [{"moments": False, "grads": False, "params": False,
                                       "main": False}] * 2
    assert result["raised_differences"] == [None, None]


def test_released_engine_refuses_updates_and_generation_until_woken_and_synced(results):
    """After the handoff vLLM's memory is released: a weight sync then would be lost (GPU sleep
    mode), so it is refused, as is generation. Waking only the weights lets the sync run while
    generation still waits for the KV cache; woken weights are stale (sleep level 2 keeps
    nothing) until a sync writes them."""
    result = results["single"]["handoff"][0]
    refused = result["released_refusals"]
    assert "weight update" in refused["weight_update"] and "'weights'" in refused["weight_update"]
    assert "resume_memory(weights=True)" in refused["weight_update"]
    assert "'kv_cache', 'weights'" in refused["generate"]
    assert "['kv_cache']" in result["kv_cache_refusal"]
    assert "stale" in result["stale_refusal"] and "sync the weights first" in result["stale_refusal"]
    assert result["synced"] and result["synced_tokens_equal"]
