"""The check that a demo run learned, shared by the learning tests of the demos."""

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
