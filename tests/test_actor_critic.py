"""Actor and critic updates through Megatron's schedules, checked across layouts.

Every layout loads the same tiny checkpoints and runs one update on the same synthetic batch; the
single-rank run is the reference. The updated weights, the loss and the old log-probs must agree
(<= 1e-5 relative) however the model is split (TP, PP, VPP, CP, EP, DP) and however the batch is
cut into micro-batches; packed log-probs must equal a padded forward's; router replay must
reproduce recorded routing in every layout; the critic must fit a fixed batch.
"""

import pytest
import torch

from megarl.algos.advantages import ADVANTAGE_ESTIMATORS
from tests.launch import finish, start

DENSE, MOE, DEEPSEEK = "qwen3", "qwen3_moe", "deepseek_v3"
ALGO = {"policy_loss": "gspo", "aggregation": "seq-mean-token-mean", "kl_loss_coeff": 0.1,
        "entropy_coeff": 0.01, "rollout_correction": {"preset": "tis"}, "eps_clip_high": 0.28}
STEPS = {"mini_batch_size": 4, "epochs": 2, "shuffle_seed": 1}
REPLAY = {"router_replay": "old"}

# name -> (model, batching, actor overrides); the reference is the single-rank run of each.
CASES = {
    "dense": (DENSE, {}, {}),
    "dense_tokens": (DENSE, {"micro_batch_tokens": 64}, {}),
    "dense_algo": (DENSE, STEPS, ALGO),
    "moe": (MOE, {}, {}),
    "moe_replay": (MOE, {}, REPLAY),
    "dense_unclipped": (DENSE, {}, {"optim": {"clip_grad": 0.0}}),
    # MLA, shared experts, sigmoid routing whose expert bias Megatron updates from the token
    # counts at each optimizer step (all-reduced over TP x DP): the bias must move identically;
    # with router replay through the group-limited, biased top-k.
    "deepseek_replay": (DEEPSEEK, {}, REPLAY),
    # Masked IS whose bounds reject every token (the rollout log-probs are 0.05 nats off).
    "dense_rejected": (DENSE, {}, {"rollout_correction": {"preset": None, "weights": "token",
                                                          "reject": "token", "low": 0.999999,
                                                          "high": 1.000001}}),
}
# layout name -> (nproc, ParallelDims fields, case -> batching used at that layout)
LAYOUTS = {
    "single": (1, {}, {"dense": {}, "dense_tokens": {"micro_batch_tokens": 64}, "dense_algo": STEPS,
                       "moe": {}, "moe_replay": {}, "dense_unclipped": {}, "deepseek_replay": {},
                       "dense_rejected": {}}),
    "tp2": (2, {"tp": 2}, {"dense": {}, "moe_replay": {"micro_batch_tokens": 96},
                           "deepseek_replay": {"micro_batch_tokens": 96}}),
    "pp2": (2, {"pp": 2}, {"dense": {"micro_batches": 3}, "moe": {"micro_batch_tokens": 96},
                           "moe_replay": {"micro_batches": 3}}),
    "ep2": (2, {"ep": 2}, {"moe": {"micro_batch_tokens": 96}, "moe_replay": {},
                           "deepseek_replay": {"micro_batch_tokens": 96}}),
    "dp2": (2, {}, {"dense": {"micro_batch_tokens": 96}, "dense_algo": STEPS, "dense_unclipped": {}}),
    "cp2": (2, {"cp": 2}, {"dense": {}, "dense_algo": STEPS}),
    "tp2pp2": (4, {"tp": 2, "pp": 2}, {"dense": {"micro_batches": 2}, "moe": {"micro_batches": 2}}),
    "pp2vpp2": (2, {"pp": 2, "vpp": 2}, {"dense": {"micro_batches": 2}}),
    "tp2ep2": (4, {"tp": 2, "ep": 2, "etp": 1}, {"moe_replay": {"micro_batch_tokens": 96}}),
}
# layout -> the critic's batching there (the dense model, 5 updates)
CRITIC = {"single": {}, "tp2": {"micro_batch_tokens": 96}}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def saved(megatron_models, tmp_path_factory):
    """The folder of every layout's results (LAYOUT/CASE.pt, the critic's LAYOUT/critic.pt): one
    launch per world size, which rebuilds the groups for each of its layouts (starting a launch
    takes 5-15 s here, a layout's updates 1-2 s); the launches run at once (the one-rank launch
    would leave a core idle)."""
    import json

    root = tmp_path_factory.mktemp("updates")
    worlds = {}
    for layout, (nproc, dims, cases) in LAYOUTS.items():
        spec = [[case, "actor", megatron_models[CASES[case][0]], batching, CASES[case][2]]
                for case, batching in cases.items()]
        if layout in CRITIC:
            spec.append(["critic", "critic", megatron_models[DENSE], CRITIC[layout], {}])
        worlds.setdefault(nproc, []).append([layout, dims, spec])
    finish(*(start("tests/workers/actor_update.py", "--layouts", json.dumps(layouts), "--out-dir", str(root),
                   nproc=nproc, timeout=900) for nproc, layouts in worlds.items()))
    return root


@pytest.fixture(scope="module")
def updates(saved):
    """{layout: {case: saved result}} for every layout."""
    return {layout: {case: torch.load(saved / layout / f"{case}.pt") for case in cases}
            for layout, (_, _, cases) in LAYOUTS.items()}


@pytest.mark.parametrize("layout,case", [(layout, case) for layout, (_, _, cases) in LAYOUTS.items()
                                         if layout != "single" for case in cases])
def test_update_is_layout_invariant(updates, layout, case):
    ref, got = updates["single"][case], updates[layout][case]
    mask = ref["mask"].bool()
    assert (got["old_logprobs"] - ref["old_logprobs"])[mask].abs().max() <= 1e-5
    assert abs(got["metrics"]["loss"] - ref["metrics"]["loss"]) <= 1e-5 * abs(ref["metrics"]["loss"])
    assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    assert ref["weights"].keys() == got["weights"].keys()
    worst = max(ref["weights"], key=lambda k: _relative(got["weights"][k], ref["weights"][k]))
    assert _relative(got["weights"][worst], ref["weights"][worst]) <= 1e-5, worst


@pytest.mark.parametrize("case", [case for case in CASES if case != "dense_rejected"])
def test_update_moves_the_policy(updates, case):
    """The comparison above means something: one update moves every layer's weights by ~lr and
    the log-probs by far more than the tolerances; the reference stays the initial policy."""
    result = updates["single"][case]
    mask = result["mask"].bool()
    moved = {k: float((result["weights"][k] - result["initial_weights"][k]).abs().max())
             for k in result["weights"]}
    assert min(moved.values()) > 1e-5, min(moved, key=moved.get)
    assert (result["logprobs_after"] - result["old_logprobs"])[mask].abs().max() > 1e-2
    assert torch.equal(result["reference_after"], result["old_logprobs"])
    assert torch.equal(result["after_again"], result["logprobs_after"])


def test_rejecting_every_token_gives_a_zero_loss_and_no_step(updates):
    """A masked-IS correction that drops every token: loss 0 (not 0 / 0), a zero gradient, no
    skipped step, and weights exactly where they were."""
    result = updates["single"]["dense_rejected"]
    metrics = result["metrics"]
    assert metrics["loss"] == 0 and metrics["policy_loss"] == 0 and metrics["grad_norm"] == 0, metrics
    assert metrics["skipped"] == 0
    for name, weight in result["weights"].items():
        assert torch.equal(weight, result["initial_weights"][name]), name


def test_unclipped_update_reports_the_gradient_norm(updates):
    """clip_grad=0 turns clipping off (Megatron then measures no norm): the reported norm is the
    same pre-clip norm the clipped run reports."""
    clipped, free = updates["single"]["dense"], updates["single"]["dense_unclipped"]
    assert free["metrics"]["grad_norm"] == pytest.approx(clipped["metrics"]["grad_norm"], rel=1e-6)
    assert clipped["metrics"]["grad_norm"] > 1.0  # so clip_grad=1 did clip the other run


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout not in ("pp2", "tp2pp2",
                                                                                 "pp2vpp2")])
def test_packed_logprobs_equal_padded(updates, layout):
    """Packed (thd, no padding compute) == a padded [N, L] forward, per response token."""
    for result in updates[layout].values():
        mask = result["mask"].bool()
        assert (result["old_logprobs"] - result["padded_logprobs"])[mask].abs().max() <= 1e-5


def _used_what_was_replayed(got, mask):
    """The routers report using exactly the replayed experts (as sets) on every real token."""
    for replayed, used in ((got["old_routing"], got["used_same"]),
                           (torch.where(got["old_routing"] >= 0, (got["old_routing"] + 1) % got["experts"],
                                        got["old_routing"]), got["used_shifted"])):
        routed = (replayed[mask] >= 0).all(-1)
        assert torch.equal(replayed[mask][routed].sort(-1).values, used[mask][routed].sort(-1).values)


@pytest.mark.parametrize("layout", ["single", "tp2", "pp2", "ep2", "tp2ep2"])
def test_router_replay(updates, layout):
    """Recorded routing is the same in every layout; replaying it (as R3 replays the engine's)
    reproduces the log-probs exactly and the routers use exactly those experts; replaying a
    different (shifted) routing changes the log-probs, identically in every layout."""
    ref, got = updates["single"]["moe_replay"], updates[layout]["moe_replay"]
    mask = ref["mask"].bool()
    experts = got["old_routing"]
    assert experts.shape == (*ref["mask"].shape, 4, 2)
    assert torch.equal(experts, ref["old_routing"])
    assert bool((experts[ref["mask"].bool()] >= 0).all())
    _used_what_was_replayed(got, mask)
    assert (got["replay_same"] - got["old_logprobs"])[mask].abs().max() <= 1e-5
    assert (got["replay_shifted"] - got["old_logprobs"])[mask].abs().max() > 0.1
    assert (got["replay_shifted"] - ref["replay_shifted"])[mask].abs().max() <= 1e-5


@pytest.mark.parametrize("layout", ["single", "tp2", "ep2"])
def test_router_replay_with_deepseek_routing(updates, layout):
    """Replay through sigmoid routing with the expert bias and group-limited top-k: the dense
    first layer records nothing (-1), the MoE layers 4 experts a token, the same in every
    layout, and replaying them reproduces the log-probs; shifted experts change them."""
    ref, got = updates["single"]["deepseek_replay"], updates[layout]["deepseek_replay"]
    mask = ref["mask"].bool()
    experts = got["old_routing"]
    assert experts.shape == (*ref["mask"].shape, 4, 4)
    assert torch.equal(experts, ref["old_routing"])
    assert bool((experts[mask][:, 0] == -1).all()) and bool((experts[mask][:, 1:] >= 0).all())
    _used_what_was_replayed(got, mask)
    assert (got["replay_same"] - got["old_logprobs"])[mask].abs().max() <= 1e-5
    assert (got["replay_shifted"] - got["old_logprobs"])[mask].abs().max() > 0.1
    assert (got["replay_shifted"] - ref["replay_shifted"])[mask].abs().max() <= 1e-5


@pytest.fixture(scope="module")
def critic_runs(saved):
    return {layout: torch.load(saved / layout / "critic.pt") for layout in CRITIC}


def test_critic_reduces_value_loss(critic_runs):
    losses = critic_runs["single"]["value_losses"]
    assert losses[-1] < 0.25 * losses[0], losses
    assert critic_runs["tp2"]["value_losses"] == pytest.approx(losses, rel=1e-4)


def _gae_loop(rewards, values, mask, gamma, lam):
    """Plain per-sequence loop: delta_t = r_t + gamma V_{t+1} - V_t over response tokens only."""
    advantages = torch.zeros_like(values)
    for i in range(values.shape[0]):
        steps = mask[i].nonzero().flatten().tolist()
        running = 0.0
        for j in reversed(range(len(steps))):
            t = steps[j]
            next_value = values[i, steps[j + 1]] if j + 1 < len(steps) else 0.0
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            running = delta + gamma * lam * running
            advantages[i, t] = running
    return advantages


def test_gae_on_critic_values_matches_loop(critic_runs):
    """PPO's advantages from the critic's real values equal a loop reference."""
    values = critic_runs["single"]["values"].double()
    mask = values.ne(0).double()
    rewards = torch.zeros_like(values)
    last = mask.cumsum(1).argmax(1)
    rewards[torch.arange(values.shape[0]), last] = torch.linspace(-1, 1, values.shape[0]).double()
    advantages, returns = ADVANTAGE_ESTIMATORS["gae"](token_rewards=rewards, values=values, mask=mask,
                                                      gamma=0.99, lam=0.95)
    expected = _gae_loop(rewards, values, mask, 0.99, 0.95)
    assert (advantages - expected).abs().max() <= 1e-10
    assert (returns - (expected + values) * mask).abs().max() <= 1e-10
