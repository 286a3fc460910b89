"""The control and data channel between trainer ranks and rollout ranks: the launcher's key-value
store (torch.distributed.Store, reachable from every node), under keys of its own.

Trainer rank 0 writes where each generation of engines starts (the data position and the
weights' version) and announces every weight push before the push itself (the push runs over the
bridge group, which the rollout ranks join when they see the announcement); the rollout leader
puts each step's finished samples, which every trainer rank reads. Trainer rank 0 requests
held-out evaluations (numbered; the rollout ranks evaluate the weights they hold when they see a
new one) and the rollout leader puts each evaluation's metrics under the request it answers. The
engine supervisors count generations (a replaced engine starts the next one). Values are
pickled. Does not own what either side does with them (rollout_ranks/server.py,
disaggregated_rollouts.py).
"""

import pickle
import time
from dataclasses import dataclass
from typing import Callable, List

import torch.distributed as dist

from megarl.rollout.engine import RolloutSample


@dataclass(frozen=True)
class Start:
    version: int          # of the weights pushed first: the step the trainers have trained up to
    sampler_state: dict   # PromptSampler.state_dict() after that step's draw (the next one: step
                          # version + 1)


@dataclass(frozen=True)
class StepRollouts:
    step: int
    # Per round (one, or with dynamic sampling as many as the rollout side drew: step_draws.py):
    rounds: List[List[int]]              # its prompts (the sampler's draw), for the trainer to check
    samples: List[List[RolloutSample]]   # prompt order, then sample order; each token's version recorded
    metrics: dict                        # the rollout side's, since the previous step's (server.py)


@dataclass(frozen=True)
class Evaluation:
    version: int   # of the weights evaluated: the step they are the weights after
    metrics: dict  # eval/<set>/<source>/<metric> (megarl/evaluation), async/eval_s, async/eval_restarts


class RolloutChannel:
    def __init__(self, store):
        self.store = dist.PrefixStore("megarl/channel", store)

    def _put(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def _get(self, key: str):
        return pickle.loads(self.store.get(key))  # waits for the key (up to the store's timeout)

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def start(self, generation: int, start: Start) -> None:
        self._put(f"start/{generation}", start)

    def wait_start(self, generation: int) -> Start:
        return self._get(f"start/{generation}")

    def generation(self) -> int:
        """The engines' current generation (0 until an engine is replaced)."""
        return int(self.store.add("generation", 0))

    def next_generation(self, seen: int) -> int:
        """Start generation seen + 1 unless another rollout rank already did; returns the current."""
        self.store.compare_set("generation", str(seen).encode(), str(seen + 1).encode())
        return self.generation()

    def announce_weights(self, generation: int, version: int) -> None:
        self._put(f"weights/{generation}/{version}", version)

    def weights_announced(self, generation: int, version: int) -> bool:
        return self._has(f"weights/{generation}/{version}")

    def put_rollouts(self, rollouts: StepRollouts) -> None:
        self._put(f"rollouts/{rollouts.step}", rollouts)

    def take_rollouts(self, step: int) -> StepRollouts:
        return self._get(f"rollouts/{step}")

    def forget_rollouts(self, step: int) -> None:
        """Free a step's samples once every trainer rank has read them."""
        self.store.delete_key(f"rollouts/{step}")

    def stop(self) -> None:
        self._put("stop", True)

    def stopping(self) -> bool:
        return self._has("stop")

    def request_evaluation(self, number: int, version: int) -> None:
        """Request `number` (0, 1, ...: the requests so far): an evaluation of the weights after
        step `version`, the last pushed."""
        self._put(f"eval/request/{number}", version)
        self.store.add("eval/requests", 1)  # counted once readable

    def evaluation_requests(self) -> int:
        """How many evaluations were requested so far."""
        return int(self.store.add("eval/requests", 0))

    def evaluation_version(self, number: int) -> int:
        return self._get(f"eval/request/{number}")

    def put_evaluation(self, request: int, evaluation: Evaluation) -> None:
        self._put(f"eval/done/{request}", evaluation)

    def has_evaluation(self, request: int) -> bool:
        return self._has(f"eval/done/{request}")

    def evaluation(self, request: int) -> Evaluation:
        """Kept (a few numbers): a replaced engine sees that the request was answered."""
        return self._get(f"eval/done/{request}")

    def wait_for_weights_or_stop(self, generation: int, version: int, other: Callable[[], bool],
                                 poll_s: float = 0.005) -> None:
        """Until weights `version` are announced, the run stops, or `other()` (an evaluation's news)."""
        while not (self.weights_announced(generation, version) or self.stopping() or other()):
            time.sleep(poll_s)

    def has_rollouts(self, step: int) -> bool:
        return self._has(f"rollouts/{step}")
