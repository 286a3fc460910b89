"""Test-only sample producers plugged into the loop by name (generation.producer=tests.producers:NAME)."""

import dataclasses


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
