"""DAPO shaping and dynamic-sampling filter against plain loops."""

import pytest
import torch

from megarl.algos.shaping import informative_groups, overlong_penalty


def test_overlong_penalty_matches_the_piecewise_definition():
    lengths = torch.arange(0, 130)
    got = overlong_penalty(lengths, max_response_len=100, buffer=20, penalty=1.0)
    for n, value in zip(lengths.tolist(), got.tolist()):
        want = 0.0 if n <= 80 else ((80 - n) / 20 if n <= 100 else -1.0)
        assert value == pytest.approx(want)
    with pytest.raises(ValueError, match="buffer 0 must lie in"):
        overlong_penalty(lengths, 100, 0, 1.0)


def test_informative_groups_drops_constant_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.7])
    group_ids = torch.tensor([3, 3, 7, 7, 1, 1, 9, 9, 9])
    want = [len({float(r) for r, g2 in zip(rewards, group_ids) if g2 == g}) > 1 for g in group_ids]
    assert informative_groups(rewards, group_ids).tolist() == want == [False, False, True, True,
                                                                        False, False, True, True, True]
