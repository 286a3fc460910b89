"""Test-only sample producers plugged into the loop by name (generation.producer=tests.producers:NAME):
one in the shortcut form (produce(engine, prompts, sampling): a whole draw at once) and one in the
streaming form (megarl/rollout/producer.py's interface)."""

import dataclasses

from megarl.rollout.completion import Completion


class FirstToken:
    """Each of the engine's completions cut to its first token (with that token's log-prob, and
    the routing of the tokens the engine fed before it): a producer whose samples differ visibly
    from plain completions."""

    def produce(self, engine, prompts, sampling):
        return [dataclasses.replace(s, response_ids=s.response_ids[:1], logprobs=s.logprobs[:1],
                                    finish_reason="length",
                                    routed_experts=None if s.routed_experts is None
                                    else s.routed_experts[:len(s.prompt_ids)])
                for s in engine.generate([p.token_ids for p in prompts], sampling)]


def first_token():
    return FirstToken()


class TwoTokens(Completion):
    """Streamed completions of at most two tokens: a user's streaming producer (here the built-in
    completion one with its budget cut), whose samples differ visibly from plain completions."""

    def start(self, driver, draw, prompts, sampling):
        super().start(driver, draw, prompts, dataclasses.replace(sampling, max_new_tokens=2))


def two_tokens():
    return TwoTokens()
