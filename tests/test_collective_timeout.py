"""A rank that never reaches a collective fails the others after the configured timeout (here
5 s), on the default group and on Megatron's subgroups alike, instead of hanging the job; and on
the trainer-rollout bridge, with the RuntimeError the trainer replaces a dead engine on."""

import pytest

from tests.launch import finish, last_json, start

GROUPS = ["world", "data_parallel", "bridge"]


@pytest.fixture(scope="module")
def results():
    """{group: what rank 0 reported}: the three launches at once, so that their waits overlap."""
    procs = finish(*(start("tests/workers/missing_rank.py", "--timeout-s", "5", "--group", group, nproc=2,
                           timeout=300, check=False) for group in GROUPS))
    return dict(zip(GROUPS, procs))


@pytest.mark.parametrize("group", GROUPS)
def test_missing_rank_fails_by_the_configured_timeout(results, group):
    result = last_json(results[group])
    assert result["error"] is not None
    assert 4 <= result["waited_s"] <= 30, result
    if group == "bridge":
        assert result["runtime_error"], result
