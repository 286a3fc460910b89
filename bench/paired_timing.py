"""What bench_rollout.py and bench_train.py share: a clean stdout for their JSON lines, and the
comparison of two code paths timed in interleaved repeats on a noisy shared machine."""

import os
import statistics


def json_stdout():
    """A line-buffered handle on the real stdout for the JSON lines; file descriptor 1 then points
    at stderr, so library loggers that write to stdout (vLLM's) and C-level prints cannot mix in."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def compare(wall: dict, cpu: dict, slow: str, fast: str) -> dict:
    """Median seconds of two paths and slow/fast ratios: of the median wall times (the figure
    the targets use), of the minima and the median of per-repeat ratios (both less touched by
    other processes on a shared machine), and of the median CPU times of this process (the work
    done, nearly blind to time spent descheduled)."""
    def median(times, name):
        return statistics.median(times[name])

    return {f"{slow}_seconds": median(wall, slow), f"{fast}_seconds": median(wall, fast),
            "ratio": median(wall, slow) / median(wall, fast),
            "ratio_of_mins": min(wall[slow]) / min(wall[fast]),
            "paired_ratio_median": statistics.median(s / f for s, f in zip(wall[slow], wall[fast])),
            f"{slow}_cpu_seconds": median(cpu, slow), f"{fast}_cpu_seconds": median(cpu, fast),
            "cpu_ratio": median(cpu, slow) / median(cpu, fast)}
