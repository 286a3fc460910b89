"""Scoring in a pool of worker processes against scoring one by one in the trainer process, on
waiting and on work.

  python bench/bench_rewards.py [--quick] [--samples N] [--workers W] [--timeout-s T]
                                [--math-samples M] [--math-workers V]

Times megarl's own Scorer (the object the loop scores with): workers=0 (in process, serial) and
workers=W, the latter twice: with the pool's start (W processes importing the function; once per
run in the loop) and without. Two cases, one JSON line each:
  sleep  a function that sleeps 0.2 s a sample (a remote verifier, an HTTP judge) on N samples;
         then a function that hangs is scored with the pool: its sample must be cut at the
         timeout. Target: pooled < serial / 4 at N=256, W=8.
  math   the built-in `math` reward (math-verify: LaTeX extraction, sympy equivalence) on M long
         model-like solutions (bench/math_solutions.py, ~4,000 characters each, half right, each
         right answer in another form than its ground truth), in a pool of V workers (default: the
         cores this process may use). This is CPU work: the pool cannot be faster than serial by
         more than the cores it runs on, however many workers it has.
Both paths must score alike, and the math case must score every right answer 1 and every wrong 0.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from math_solutions import solutions  # noqa: E402
from paired_timing import json_stdout  # noqa: E402

from megarl.rewards.functions import Request, RewardTable  # noqa: E402
from megarl.rewards.scorer import Scorer  # noqa: E402

SLOW = "slow_reward:slow_exact_match"
SLEEP_TARGET_SPEEDUP = 4.0
# A sample's bound, as the loop's algo.reward_timeout_s: --timeout-s is the hang check's, and a
# worker's first math-verify call (lazy imports, ~0.2-0.4 s per kind of answer) can pass it.
MATH_TIMEOUT_S = 60.0


def _no_tokens(requests):
    return [[]] * len(requests)  # token ids are read by reward models only, and none is named


def _timed(scorer: Scorer, requests) -> tuple:
    start = time.monotonic()
    scores = scorer.score(requests, _no_tokens(requests))
    return time.monotonic() - start, scores


def serial_vs_pool(reward: str, requests, workers: int, timeout_s: float, warm_up: int = 0) -> tuple:
    """(timings, the serial scores): serial, the pool's first call (its start and its workers'
    first calls included) and a second call on the started pool. The serial path first scores
    `warm_up` requests untimed, so that both timed calls it is compared with run warm. Raises if
    the pool scored differently."""
    serial_scorer = Scorer(RewardTable(reward), 0, timeout_s)
    serial_scorer.score(requests[:warm_up], _no_tokens(requests[:warm_up]))
    serial_s, serial = _timed(serial_scorer, requests)
    serial_scorer.close()
    start = time.monotonic()
    pooled_scorer = Scorer(RewardTable(reward), workers, timeout_s)
    pooled = pooled_scorer.score(requests, _no_tokens(requests))
    first_s = time.monotonic() - start
    pooled_s, again = _timed(pooled_scorer, requests)
    pooled_scorer.close()
    for scores in (pooled, again):
        differ = int((serial.rewards != scores.rewards).sum())
        if differ or scores.failures:
            # The math reward's own 5 s timeouts (rewards/builtin.py) apply in the workers, not in
            # the serial path's thread: on an overloaded machine they score right answers 0.
            raise RuntimeError(f"the pool scored {differ} samples differently from the serial path "
                               f"({scores.failures} failures, first: {scores.first_error})")
    timings = {"samples": len(requests), "workers": workers, "serial_s": round(serial_s, 3),
               "pooled_s": round(pooled_s, 3), "pooled_first_s": round(first_s, 3),
               "speedup": round(serial_s / pooled_s, 2), "speedup_with_start": round(serial_s / first_s, 2)}
    return timings, serial


def sleep_case(samples: int, workers: int, timeout_s: float) -> dict:
    requests = [Request(str(i % 7), "3") for i in range(samples)]
    timings, _ = serial_vs_pool(SLOW, requests, workers, timeout_s)
    hanging = Scorer(RewardTable("slow_reward:hangs_on_request"), workers, timeout_s)
    hang_s, hung = _timed(hanging, [Request("hang", ""), *[Request("ok", "") for _ in range(7)]])
    hanging.close()
    return {"bench": "rewards", "case": "sleep", **timings, "seconds_per_sample": 0.2,
            "target_speedup": SLEEP_TARGET_SPEEDUP, "meets_target": timings["speedup"] > SLEEP_TARGET_SPEEDUP,
            "hang_timeout_s": timeout_s, "hang_scored_s": round(hang_s, 3),
            "hang_timeouts": hung.timeouts, "hang_rewards": hung.rewards.tolist()}


def math_case(samples: int, workers: int) -> dict:
    solved = solutions(samples, seed=0)
    requests = [Request(s.response, s.ground_truth) for s in solved]
    # Every kind of answer is in the first 8: the in-process path warms up on them.
    timings, serial = serial_vs_pool("math", requests, workers, MATH_TIMEOUT_S, warm_up=8)
    right = [float(s.correct) for s in solved]
    if serial.rewards.tolist() != right:
        wrong = [i for i, (got, want) in enumerate(zip(serial.rewards.tolist(), right)) if got != want]
        raise RuntimeError(f"math-verify scored {len(wrong)} solutions against their truth, first "
                           f"{solved[wrong[0]].ground_truth!r} (right: {solved[wrong[0]].correct})")
    cores = len(os.sched_getaffinity(0))
    return {"bench": "rewards", "case": "math", **timings, "cores": cores,
            "response_chars_mean": round(sum(len(s.response) for s in solved) / samples),
            "serial_ms_per_sample": round(timings["serial_s"] / samples * 1e3, 2),
            "scored_right": int(serial.rewards.sum()), "answers_right": int(sum(right)),
            # CPU-bound: W workers share the cores, so the pool's ceiling is min(W, cores).
            "speedup_ceiling": min(workers, cores)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 sleeping and 256 math samples (make bench)")
    parser.add_argument("--samples", type=int, default=256, help="the sleep case's samples")
    parser.add_argument("--math-samples", type=int, default=1024)
    parser.add_argument("--math-workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=2.0, help="the hang check's timeout")
    args = parser.parse_args()
    out = json_stdout()
    samples, math_samples = (64, 256) if args.quick else (args.samples, args.math_samples)
    out.write(json.dumps(sleep_case(samples, args.workers, args.timeout_s)) + "\n")
    out.write(json.dumps(math_case(math_samples, args.math_workers)) + "\n")


if __name__ == "__main__":
    main()
