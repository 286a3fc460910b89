"""The draws a streaming producer has in flight: each draw's samples in the making, in prompt
order then sample order, handed back once every one is done. The base class of the built-in
producers (completion.py, rollout/agent/loop.py), which differ in what one sample is (a turn, a
conversation).

Owns the bookkeeping of draws. Does not own driving the engine (turns.py) or what a sample is.
"""

from typing import Dict, Generic, List, Optional, Protocol, Sequence, TypeVar, Union

from megarl.rollout.engine import RolloutSample
from megarl.rollout.turns import Turn, TurnDriver

Draw = Union[int, str]  # a training step's number, or a held-out set's key


class InMaking(Protocol):
    done: bool

    def live_turn(self) -> Optional[Turn]:
        """The turn it has in the engine, if any."""

    def sample(self, versions: bool) -> RolloutSample:
        """The finished sample; `versions`: with each response token's policy version."""


Item = TypeVar("Item", bound=InMaking)


class Draws(Generic[Item]):
    """The draw bookkeeping half of a SampleProducer (producer.py): `finished`, `drop`, `busy` and
    `draws_in_flight`, over the items a subclass's `start` adds."""

    def __init__(self):
        self._draws: Dict[Draw, List[Item]] = {}

    def _add(self, draw: Draw, items: Sequence[Item]) -> None:
        if draw in self._draws:
            raise ValueError(f"draw {draw!r} is already in flight")
        self._draws[draw] = list(items)

    def finished(self, driver: TurnDriver, draw: Draw) -> Optional[List[RolloutSample]]:
        items = self._draws.get(draw)
        if items is None or not all(item.done for item in items):
            return None
        del self._draws[draw]
        return [item.sample(driver.tracks_versions) for item in items]

    def drop(self, driver: TurnDriver, draw: Draw) -> List[Item]:
        """Forget `draw` (its turns in the engine aborted); returns its items."""
        items = self._draws.pop(draw, [])
        driver.abort([turn for turn in (item.live_turn() for item in items) if turn is not None])
        return items

    def busy(self) -> bool:
        return any(not item.done for items in self._draws.values() for item in items)

    def draws_in_flight(self) -> int:
        return len(self._draws)
