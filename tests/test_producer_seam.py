"""The SampleProducer seam's edge (megarl/rollout/producer.py): the built-ins and a user's
streaming producer are taken as they are, a user's produce() shortcut is adapted, and anything
else is refused naming both forms. (Producers driving a real engine: tests/test_streaming_rollout.py,
test_agent_loop.py, test_loop.py and test_async_rollout.py.)"""

import pytest

from megarl.rollout.agent.loop import AgentConfig, AgentLoop
from megarl.rollout.completion import Completion
from megarl.rollout.producer import WholeDraws, load_producer
from tests.producers import FirstToken, TwoTokens


def test_streaming_producers_are_taken_as_they_are_and_the_shortcut_is_adapted():
    assert type(load_producer("completion", None, AgentConfig())) is Completion
    agent = load_producer("agent", None, AgentConfig())
    assert type(agent) is AgentLoop and agent._pool is None  # tool workers start at the first call
    assert type(load_producer("tests.producers:two_tokens", None, AgentConfig())) is TwoTokens
    shortcut = load_producer("tests.producers:first_token", None, AgentConfig())
    assert type(shortcut) is WholeDraws and type(shortcut.simple) is FirstToken
    assert not shortcut.busy() and shortcut.draws_in_flight() == 0


def neither():
    return object()


def test_a_producer_of_neither_form_is_refused_naming_both():
    with pytest.raises(TypeError, match=r"generation.producer='tests.test_producer_seam:neither' returned "
                                        r"object, which has neither produce\(engine, prompts, sampling\) "
                                        r"nor the streaming methods \['start', 'step'"):
        load_producer("tests.test_producer_seam:neither", None, AgentConfig())
