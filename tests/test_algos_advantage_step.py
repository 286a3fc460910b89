"""The loop's advantage step (reward placement, DAPO overlong shaping, KL penalty, whitening) for
every estimator against a plain loop reference (python floats, one sequence and token at a time),
and the run-level conventions: whitening defaults, lone groups, KL clamp, Dr. GRPO's constant,
GSPO's aggregation."""

import math

import pytest
import torch

from megarl.actor.config import ActorConfig, require_norm_tokens
from megarl.actor.passes import global_counts
from megarl.algos.advantage_step import advantage_step
from megarl.algos.advantages import ADVANTAGE_ESTIMATORS, WHITENED_BY_DEFAULT
from megarl.batch.rollout_batch import RolloutBatch
from megarl.critic.config import CriticConfig
from megarl.planning.config import AlgoConfig, ModelConfig, RunConfig
from megarl.rollout.config import DataConfig, GenerationConfig
from megarl.trainer.loop import with_advantages
from tests.test_algos_advantages import (
    GROUP_IDS,
    _broadcast,
    _real,
    _ref_centered,
    _ref_gae,
    _ref_groups,
    _ref_rloo,
    _ref_whiten,
)

T = 11
MAX_NEW = 8
PROMPTS = [1, 2, 1, 3, 1, 2, 1, 1, 2, 1]  # prompt tokens before each response
RESPONSES = [8, 1, 5, 2, 7, 8, 3, 6, 2, 4]  # response tokens (8 = the budget: overlong)
EPS = 1e-6
KL_FORMULAS = {"k1": lambda lp, rf: lp - rf, "k2": lambda lp, rf: 0.5 * (lp - rf) ** 2,
               "k3": lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1}


def _inputs():
    g = torch.Generator().manual_seed(3)
    b = len(GROUP_IDS)
    cols = torch.arange(T)[None, :]
    prompt, resp = torch.tensor(PROMPTS)[:, None], torch.tensor(RESPONSES)[:, None]
    mask = ((cols >= prompt) & (cols < prompt + resp)).double()
    nan = torch.full((b, T), float("nan"), dtype=torch.float64)
    real = mask.bool()
    return dict(
        rewards=torch.randint(0, 2, (b,), generator=g).double() + 0.1 * torch.randn(b, generator=g,
                                                                                  dtype=torch.float64),
        mask=mask, group_ids=torch.tensor(GROUP_IDS),
        values=torch.where(real, torch.randn(b, T, generator=g, dtype=torch.float64), nan),
        # Policies 1-2 nats apart on some tokens, so k3 exceeds a clamp of 1.
        logprobs=torch.where(real, -torch.rand(b, T, generator=g, dtype=torch.float64) * 3, nan),
        ref_logprobs=torch.where(real, -torch.rand(b, T, generator=g, dtype=torch.float64) * 3, nan))


def _step(inputs, estimator, **overrides):
    kwargs = dict(estimator=estimator, gamma=0.9, lam=0.8, eps=EPS,
                  whiten_advantages=WHITENED_BY_DEFAULT[estimator], lone_groups="zero", kl_coeff=0.0,
                  kl_estimator="k1", kl_clamp=None, max_response_len=MAX_NEW, overlong_buffer=0,
                  overlong_penalty=1.0)
    return advantage_step(**inputs, **{**kwargs, **overrides})


def _ref_token_rewards(inputs, kl_coeff, kl_estimator, kl_clamp, overlong_buffer, overlong_penalty):
    """Score on the last response token, minus the per-token KL penalty: python floats."""
    mask = inputs["mask"]
    out = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        real = _real(mask, i)
        score = float(inputs["rewards"][i])
        if overlong_buffer:
            over = max(len(real) - (MAX_NEW - overlong_buffer), 0) / overlong_buffer
            score -= overlong_penalty * min(over, 1.0)
        out[i, real[-1]] = score
        for t in real:
            if kl_coeff:
                lp, rf = float(inputs["logprobs"][i, t]), float(inputs["ref_logprobs"][i, t])
                k = KL_FORMULAS[kl_estimator](lp, rf)
                if kl_clamp is not None:
                    k = max(-kl_clamp, min(kl_clamp, k))
                out[i, t] -= kl_coeff * k
    return out


def _ref_grpo(batch, lone_reward):
    r = batch["seq_rewards"].tolist()
    out = [0.0] * len(r)
    for members in _ref_groups(batch).values():
        if len(members) == 1:
            out[members[0]] = r[members[0]] / (1 + EPS) if lone_reward else 0.0
            continue
        mean = sum(r[i] for i in members) / len(members)
        std = math.sqrt(sum((r[i] - mean) ** 2 for i in members) / (len(members) - 1))
        for i in members:
            out[i] = (r[i] - mean) / (std + EPS)
    return out


def _reference(inputs, estimator, whiten, kl_coeff=0.0, kl_estimator="k1", kl_clamp=None,
               overlong_buffer=0, overlong_penalty=1.0, lone_reward=False):
    mask = inputs["mask"]
    token = _ref_token_rewards(inputs, kl_coeff, kl_estimator, kl_clamp, overlong_buffer, overlong_penalty)
    seq = torch.tensor([sum(row) for row in token.tolist()], dtype=torch.float64)
    batch = dict(token_rewards=token, seq_rewards=seq,
                 values=inputs["values"], mask=mask, group_ids=inputs["group_ids"], eps=EPS)
    lone = [members[0] for members in _ref_groups(batch).values() if len(members) == 1]

    def outcome(per_seq):
        if lone_reward:
            per_seq = [float(batch["seq_rewards"][i]) if i in lone else a for i, a in enumerate(per_seq)]
        return _broadcast(per_seq, mask)

    raw = {
        "gae": lambda: _ref_gae(batch, 0.9, 0.8),
        "reinforce_plus_plus": lambda: _ref_gae(batch, 0.9, 1.0, values=False),
        "grpo": lambda: _broadcast(_ref_grpo(batch, lone_reward), mask),
        "dr_grpo": lambda: outcome(_ref_centered(batch)),
        "rloo": lambda: outcome(_ref_rloo(batch)),
        "reinforce_plus_plus_baseline": lambda: outcome(_ref_centered(batch)),
    }[estimator]()
    return _ref_whiten(raw, mask, EPS) if whiten else raw, raw


def _close(a, b, tol=1e-9):
    assert a.shape == b.shape and not torch.isnan(a).any()
    torch.testing.assert_close(a, b, rtol=0, atol=tol)


KL_CASES = {"no_kl": {}, "k1": dict(kl_coeff=0.3, kl_estimator="k1"),
            "k3_clamped": dict(kl_coeff=0.3, kl_estimator="k3", kl_clamp=1.0)}


@pytest.mark.parametrize("kl_case", sorted(KL_CASES))
@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_advantage_step_matches_loop_reference(estimator, kl_case):
    inputs = _inputs()
    options = dict(KL_CASES[kl_case], overlong_buffer=3, overlong_penalty=0.5)
    whiten = WHITENED_BY_DEFAULT[estimator]
    advantages, returns = _step(inputs, estimator, **options)
    want, raw = _reference(inputs, estimator, whiten, **options)
    # The overlong penalty is computed in float32 (shaping.py), the reference in float64.
    _close(advantages, want, tol=1e-7)
    if estimator == "gae":  # the critic's targets: unwhitened advantages + values
        _close(returns, torch.where(inputs["mask"].bool(), raw + inputs["values"], 0), tol=1e-7)


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_kl_penalty_changes_every_estimator_by_the_reference_amount(estimator):
    inputs = _inputs()
    whiten = WHITENED_BY_DEFAULT[estimator]
    plain = _step(inputs, estimator)[0]
    penalized = _step(inputs, estimator, kl_coeff=0.3, kl_estimator="k3")[0]
    change = penalized - plain
    want = _reference(inputs, estimator, whiten, kl_coeff=0.3, kl_estimator="k3")[0] - \
        _reference(inputs, estimator, whiten)[0]
    assert float(change.abs().max()) > 1e-2, f"{estimator}: the KL penalty had no effect"
    _close(change, want)


def _batch(inputs):
    b = len(GROUP_IDS)
    lengths = torch.tensor(PROMPTS) + torch.tensor(RESPONSES)
    mask = inputs["mask"].float()
    real = mask.bool()
    return RolloutBatch(tokens=torch.zeros(b, T, dtype=torch.long), lengths=lengths, loss_mask=mask,
                        group_ids=inputs["group_ids"], rewards=inputs["rewards"].float(),
                        values=torch.where(real, inputs["values"], 0).float(),
                        old_logprobs=torch.where(real, inputs["logprobs"], 0).float(),
                        ref_logprobs=torch.where(real, inputs["ref_logprobs"], 0).float())


def test_gae_run_whitens_by_default_and_false_gives_the_raw_estimate():
    inputs = _inputs()
    batch = _batch(inputs)  # float32, as in a run
    assert AlgoConfig(advantage="gae").whitens and not AlgoConfig(advantage="gae",
                                                                   whiten_advantages=False).whitens
    default = with_advantages(batch, AlgoConfig(advantage="gae", gamma=0.9, lam=0.8), MAX_NEW)
    real = default.advantages[batch.loss_mask.bool()]
    assert abs(float(real.mean())) < 1e-5 and abs(float(real.std()) - 1) < 1e-4
    _close(default.advantages.double(), _reference(inputs, "gae", whiten=True)[0], tol=1e-5)
    raw = with_advantages(batch, AlgoConfig(advantage="gae", gamma=0.9, lam=0.8,
                                            whiten_advantages=False), MAX_NEW)
    # Unwhitened is the GAE recursion on the token rewards, as before whitening existed.
    _close(raw.advantages.double(), _reference(inputs, "gae", whiten=False)[0], tol=1e-5)
    torch.testing.assert_close(raw.returns, default.returns, rtol=0, atol=0)
    # grpo is normalized per group and is not whitened again unless asked.
    grpo = with_advantages(batch, AlgoConfig(advantage="grpo"), MAX_NEW)
    _close(grpo.advantages.double(), _reference(inputs, "grpo", whiten=False)[0], tol=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_lone_groups_zero_or_their_reward(estimator):
    inputs = _inputs()
    lone = GROUP_IDS.index(2)
    whiten = WHITENED_BY_DEFAULT[estimator]
    zero = _step(inputs, estimator)[0]
    reward = _step(inputs, estimator, lone_groups="reward")[0]
    _close(reward, _reference(inputs, estimator, whiten, lone_reward=True)[0])
    if not whiten:
        assert torch.all(zero[lone] == 0)
        _close(reward[lone][inputs["mask"][lone].bool()],
               inputs["rewards"][lone].expand(RESPONSES[lone]) / (1 + EPS if estimator == "grpo" else 1))
    with pytest.raises(ValueError, match="lone_groups='none'.*'zero', 'reward'"):
        _step(inputs, estimator, lone_groups="none")
    with pytest.raises(ValueError, match="algo.lone_groups='verl'"):
        AlgoConfig(lone_groups="verl")


def test_kl_clamp_limits_the_penalty_and_is_validated():
    inputs = _inputs()
    clamped = _step(inputs, "reinforce_plus_plus", kl_coeff=1.0, kl_estimator="k3", kl_clamp=1.0,
                    whiten_advantages=False)
    free = _step(inputs, "reinforce_plus_plus", kl_coeff=1.0, kl_estimator="k3", whiten_advantages=False)
    assert not torch.equal(clamped[0], free[0])
    with pytest.raises(ValueError, match="algo.kl_clamp=0"):
        AlgoConfig(kl_clamp=0)
    with pytest.raises(ValueError, match="actor.kl_clamp=-1"):
        ActorConfig(kl_clamp=-1)


def _run_config(**sections):
    return RunConfig(model=ModelConfig(hf_dir="hf"), data=DataConfig(path="p.jsonl"),
                     generation=GenerationConfig(max_new_tokens=48), **sections)


def test_dr_grpo_constant_is_the_generation_budget_whatever_the_batch_width():
    config = _run_config(actor=ActorConfig(aggregation="seq-mean-token-sum-norm"))
    assert config.actor_config.norm_tokens == 48 and config.critic_config.norm_tokens == 48
    assert _run_config(actor=ActorConfig(norm_tokens=100)).actor_config.norm_tokens == 100
    counts = []
    for width in (12, 40):
        lengths = torch.tensor([5, width])
        cols = torch.arange(width)[None, :]
        batch = RolloutBatch(tokens=torch.zeros(2, width, dtype=torch.long), lengths=lengths,
                             loss_mask=((cols >= 2) & (cols < lengths[:, None])).float(),
                             group_ids=torch.tensor([0, 0]))
        counts.append(global_counts(batch, torch.arange(2), config.actor_config.norm_tokens)["max_len"])
    assert counts == [48, 48]
    with pytest.raises(ValueError, match="actor.aggregation='seq-mean-token-sum-norm'.*actor.norm_tokens"):
        require_norm_tokens(config.actor.loss_aggregation, config.actor.norm_tokens, "actor")
    with pytest.raises(ValueError, match="critic.norm_tokens=0"):
        CriticConfig(norm_tokens=0)


def test_policy_losses_default_to_their_own_aggregation():
    assert ActorConfig(policy_loss="gspo").loss_aggregation == "seq-mean-token-mean"
    assert ActorConfig(policy_loss="ppo").loss_aggregation == "token-mean"
    assert ActorConfig(policy_loss="gspo", aggregation="token-mean").loss_aggregation == "token-mean"
    with pytest.raises(ValueError, match="'token-sum'.*seq-mean-token-mean"):
        ActorConfig(aggregation="token-sum")
