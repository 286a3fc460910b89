"""Staleness statistics of asynchronous rollouts against a plain loop over tokens, fuzzed over
shapes, versions and masks; and the configurations asynchronous training refuses."""

import random

import pytest
import torch

from megarl.algos.staleness import sequence_lags, staleness_metrics, token_lags
from megarl.planning.config import RunConfig
from megarl.planning.typed_config import build


def _reference(versions, mask, trainer_version, old, rollout):
    lags, gaps, per_row, mixed = [], {}, [], 0
    for i in range(versions.shape[0]):
        row = [(int(versions[i, j]), float(old[i, j] - rollout[i, j]))
               for j in range(versions.shape[1]) if mask[i, j]]
        per_row.append(max((trainer_version - v for v, _ in row), default=0))
        mixed += len({v for v, _ in row}) > 1
        for v, gap in row:
            lags.append(trainer_version - v)
            gaps.setdefault(trainer_version - v, []).append(abs(gap))
    return lags, gaps, per_row, mixed


@pytest.mark.parametrize("seed", range(6))
def test_staleness_matches_a_loop_over_tokens(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, width, trainer_version = rng.randint(1, 6), rng.randint(2, 12), rng.randint(0, 5)
    mask = (torch.rand(n, width, generator=gen) < 0.7).float()
    mask[0, rng.randrange(width)] = 1.0  # at least one real token
    versions = torch.randint(max(0, trainer_version - 3), trainer_version + 1, (n, width), generator=gen)
    versions = torch.where(mask.bool(), versions, -1)
    old, rollout = torch.randn(n, width, generator=gen), torch.randn(n, width, generator=gen)
    got = staleness_metrics(versions, mask, trainer_version, old, rollout)
    lags, gaps, per_row, mixed = _reference(versions, mask, trainer_version, old, rollout)
    assert token_lags(versions, mask, trainer_version).tolist() == lags
    assert sequence_lags(versions, mask, trainer_version).tolist() == per_row
    assert got["async/version_lag_max"] == max(lags)
    assert got["async/version_lag_mean"] == pytest.approx(sum(lags) / len(lags))
    assert got["async/stale_token_fraction"] == pytest.approx(sum(lag > 0 for lag in lags) / len(lags))
    assert got["async/mixed_version_samples"] == mixed
    for lag, values in gaps.items():
        assert got[f"async/mismatch_lag{lag}_max"] == pytest.approx(max(values))
        assert got[f"async/mismatch_lag{lag}_mean"] == pytest.approx(sum(values) / len(values))
    assert not {k for k in got if k.startswith("async/mismatch_lag")} - {
        f"async/mismatch_lag{lag}_{s}" for lag in gaps for s in ("max", "mean")}


def test_a_response_token_without_a_version_is_refused():
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="no recorded version"):
        token_lags(torch.tensor([[-1, 3, -1]]), mask, 3)


BASE = {"model": {"hf_dir": "m"}, "data": {"path": "d.jsonl"}}


@pytest.mark.parametrize("extra, message", [
    ({"async": {"max_staleness": 1}}, r"async.max_staleness=1: the async section applies only to rollout "
                                      r"ranks of their own \(layout.rollout_world_size > 0\)"),
    # keys a colocated run would ignore are refused with the others
    ({"async": {"partial_rollout": "restart", "max_engine_restarts": 0}},
     r"async.partial_rollout='restart', async.max_engine_restarts=0: the async section applies only"),
    ({"async": {"max_staleness": -1}, "layout": {"rollout_world_size": 1}}, r"must be >= 0"),
    ({"async": {"partial_rollout": "resume"}, "layout": {"rollout_world_size": 1}},
     r"async.partial_rollout='resume'; choose one of \('continue', 'restart'\)"),
    ({"layout": {"rollout_world_size": 3, "rollout_tp": 2}},
     r"layout.rollout_world_size=3: .* layout.rollout_tp=2 ranks each, so give a multiple of 2"),
    ({"layout": {"rollout_world_size": 1}, "algo": {"dynamic_sampling_rounds": 2, "reward": "math + rm:/rm"}},
     r"algo.dynamic_sampling_rounds with reward models \(rm:\) in algo.reward=2 with rollout ranks of "
     r"their own \(layout.rollout_world_size=1\): the rollout ranks judge"),
    ({"layout": {"rollout_world_size": 1}, "offload_params": True},
     r"offload_params=True with rollout ranks .*: the trainer ranks hold no engine"),
])
def test_asynchronous_configs_that_cannot_work_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        build(RunConfig, {**BASE, **extra})


@pytest.mark.parametrize("extra", [
    {"actor": {"router_replay": "rollout"}},  # routing streams with each sample
    {"algo": {"dynamic_sampling_rounds": 2}},  # rounds judged on the rollout side
    {"generation": {"producer": "agent", "return_routing": True}},
    {"generation": {"producer": "my_rollouts:make_producer"}},  # a user's, loaded at setup
    {"generation": {"producer": "agent"}, "layout": {"rollout_world_size": 2, "rollout_tp": 2}},
    {"layout": {"rollout_world_size": 4, "rollout_tp": 2}},  # two engines (rollout/shares.py)
    {"generation": {"producer": "agent"}, "layout": {"rollout_world_size": 2}},
])
def test_what_composes_with_rollout_ranks_of_their_own_is_accepted(extra):
    layout = {"rollout_world_size": 1, **extra.get("layout", {})}
    config = build(RunConfig, {**BASE, **extra, "layout": layout, "async": {"max_staleness": 1}})
    assert config.layout.disaggregated and config.async_.max_staleness == 1


def test_async_is_the_yaml_key_of_the_async_section():
    config = build(RunConfig, {**BASE, "layout": {"rollout_world_size": 2, "rollout_tp": 2},
                               "async": {"max_staleness": 2, "partial_rollout": "restart"}})
    assert config.async_.max_staleness == 2 and config.async_.partial_rollout == "restart"
    assert config.layout.disaggregated
