"""The draws a streaming producer has in flight: each draw's samples in the making, in prompt
order then sample order, handed back once every one is done. Shared by the built-in producers
(completion.py, agent_loop.py), which differ in what one sample is (a turn, a conversation).

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
    def __init__(self):
        self.draws: Dict[Draw, List[Item]] = {}

    def add(self, draw: Draw, items: Sequence[Item]) -> None:
        if draw in self.draws:
            raise ValueError(f"draw {draw!r} is already in flight")
        self.draws[draw] = list(items)

    def finished(self, draw: Draw, driver_tracks_versions: bool) -> Optional[List[RolloutSample]]:
        items = self.draws.get(draw)
        if items is None or not all(item.done for item in items):
            return None
        del self.draws[draw]
        return [item.sample(driver_tracks_versions) for item in items]

    def drop(self, driver: TurnDriver, draw: Draw) -> List[Item]:
        """Forget `draw` (its turns in the engine aborted); returns its items."""
        items = self.draws.pop(draw, [])
        driver.abort([turn for turn in (item.live_turn() for item in items) if turn is not None])
        return items

    def unfinished(self) -> bool:
        return any(not item.done for items in self.draws.values() for item in items)

    def __len__(self) -> int:
        return len(self.draws)
