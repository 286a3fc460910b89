"""Scoring in a pool of worker processes against scoring one by one in the trainer process, with
a reward function that sleeps 0.2 s a sample (a remote verifier, a sandbox, an HTTP judge).

  python bench/bench_rewards.py [--quick] [--samples N] [--workers W] [--timeout-s T]

Times megarl's own Scorer (the object the loop scores with) on N samples: workers=0 (in process,
serial) and workers=W, the latter twice: with the pool's start (W processes importing the
function; once per run in the loop) and without. Then a function that hangs is scored with the
pool: its sample must be cut at the timeout. Prints one JSON object; target: pooled < serial / 4
at N=256, W=8.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from paired_timing import json_stdout  # noqa: E402

from megarl.rewards.functions import Request, RewardTable  # noqa: E402
from megarl.rewards.scorer import Scorer  # noqa: E402

SLOW = "slow_reward:slow_exact_match"


def _no_tokens(requests):
    return [[]] * len(requests)  # token ids are read by reward models only, and none is named


def _timed(scorer: Scorer, requests) -> tuple:
    start = time.monotonic()
    scores = scorer.score(requests, _no_tokens(requests))
    return time.monotonic() - start, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 samples (make bench)")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args()
    out = json_stdout()
    samples = 64 if args.quick else args.samples
    requests = [Request(str(i % 7), "3") for i in range(samples)]

    serial_s, serial = _timed(Scorer(RewardTable(SLOW), 0, args.timeout_s), requests)
    start = time.monotonic()
    pooled_scorer = Scorer(RewardTable(SLOW), args.workers, args.timeout_s)
    pooled = pooled_scorer.score(requests, _no_tokens(requests))
    first_s = time.monotonic() - start  # the pool's start included
    pooled_s, _ = _timed(pooled_scorer, requests)
    pooled_scorer.close()

    hanging = Scorer(RewardTable("slow_reward:hangs_on_request"), args.workers, args.timeout_s)
    hang_s, hung = _timed(hanging, [Request("hang", ""), *[Request("ok", "") for _ in range(7)]])
    hanging.close()

    if not (serial.rewards == pooled.rewards).all():
        raise RuntimeError("the pool scored differently from the serial path")
    out.write(json.dumps({
        "bench": "rewards", "samples": samples, "workers": args.workers, "seconds_per_sample": 0.2,
        "serial_s": round(serial_s, 3), "pooled_s": round(pooled_s, 3), "pooled_first_s": round(first_s, 3),
        "speedup": round(serial_s / pooled_s, 2), "speedup_with_start": round(serial_s / first_s, 2),
        "target_speedup": 4.0, "meets_target": serial_s / pooled_s > 4.0,
        "hang_timeout_s": args.timeout_s, "hang_scored_s": round(hang_s, 3),
        "hang_timeouts": hung.timeouts, "hang_rewards": hung.rewards.tolist(),
    }) + "\n")


if __name__ == "__main__":
    main()
