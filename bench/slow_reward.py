"""A reward function as slow as a remote verifier or a sandbox (bench_rewards.py scores with it)."""

import time

SECONDS = 0.2


def slow_exact_match(response: str, ground_truth: str) -> float:
    time.sleep(SECONDS)
    return float(response.strip() == ground_truth.strip())


def hangs_on_request(response: str, ground_truth: str) -> float:
    if response == "hang":
        time.sleep(3600)
    return 1.0
