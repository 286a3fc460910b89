"""A pytest plugin that writes, per test, its wall seconds and the CPU seconds the whole machine
spent meanwhile (/proc/stat: user, nice, system, irq, softirq, steal), one JSON line each, to the
file named by MEGARL_CPU_PROFILE. On an otherwise idle machine that CPU is the test's own,
launches, engines and servers included, which no per-process count sees (forked ranks, Ray).

    MEGARL_CPU_PROFILE=/tmp/cpu.jsonl pytest -p tests.cpu_profile tests

docs/testing.md ("Where the CPU goes") lists what it measured over the whole suite."""

import json
import os
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of one test: a module fixture's launch counts to its first test."""
    began, busy = time.monotonic(), _busy_seconds()
    yield
    row = {"test": item.nodeid, "wall_s": round(time.monotonic() - began, 2),
           "cpu_s": round(_busy_seconds() - busy, 2)}
    with open(os.environ["MEGARL_CPU_PROFILE"], "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_configure(config):
    if "MEGARL_CPU_PROFILE" not in os.environ:
        raise pytest.UsageError("-p tests.cpu_profile writes to the file MEGARL_CPU_PROFILE names: set it "
                                "(MEGARL_CPU_PROFILE=/tmp/cpu.jsonl)")
