"""A rank that never reaches a collective fails the others after the configured timeout (here
5 s), on the default group and on Megatron's subgroups alike, instead of hanging the job; and on
the trainer-rollout bridge, with the RuntimeError the trainer replaces a dead engine on."""

import pytest

from tests.launch import last_json, run


@pytest.mark.parametrize("group", ["world", "data_parallel", "bridge"])
def test_missing_rank_fails_by_the_configured_timeout(group):
    result = last_json(run("tests/workers/missing_rank.py", "--timeout-s", "5", "--group", group,
                           nproc=2, timeout=120, check=False))
    assert result["error"] is not None
    assert 4 <= result["waited_s"] <= 30, result
    if group == "bridge":
        assert result["runtime_error"], result
