"""The checks that a demo run learned, shared by the learning tests of the demos."""

from typing import List, Optional


def assert_learned(steps: List[dict], count: int, last: int, min_rise: float,
                   min_kl: Optional[float] = None) -> None:
    """The run has `count` steps; the mean reward of its `last` steps beats its first 5 steps' by
    `min_rise`; with `min_kl`, the actor's mean KL to the reference over those last steps is at
    least that: a frozen policy's reward can rise by chance, but it does not move."""
    rewards = [s["reward/mean"] for s in steps]
    assert len(rewards) == count
    first, final = sum(rewards[:5]) / 5, sum(rewards[-last:]) / last
    assert final - first >= min_rise, \
        f"reward {first:.3f} (steps 1-5) -> {final:.3f} (steps {count - last + 1}-{count}): {rewards}"
    if min_kl is not None:
        kl = [s["kl/actor_to_reference"] for s in steps]
        assert sum(kl[-last:]) / last >= min_kl, f"the actor hardly moved from the reference: {kl}"


def assert_heldout_rises(rows: List[dict], count: int, min_rise: float, name: str = "heldout") -> None:
    """The accuracy on held-out set `name` (its prompts are in no training prompt, so recalling
    the trained ones does not raise it) after the run's last step, `count`, beats the at-start
    evaluation's (step 0) by `min_rise`."""
    key = f"eval/{name}/all/accuracy"
    evaluated = {row["step"]: row[key] for row in rows if key in row}
    assert {0, count} <= set(evaluated), f"no held-out evaluation at step 0 and step {count}: {evaluated}"
    assert evaluated[count] - evaluated[0] >= min_rise, \
        f"held-out accuracy {evaluated[0]:.3f} (step 0) -> {evaluated[count]:.3f} (step {count}): {evaluated}"
