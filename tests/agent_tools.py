"""Tools and interactions for the agent loop's tests, named by module:function. `mode` comes from a
record's extra_info.tools_kwargs, as verl's tools_kwargs reach its tools."""

import time

from megarl.rollout.agent.tools import calculator as builtin_calculator


def calculator(expression: str, mode: str = "ok") -> str:
    """Evaluate an arithmetic expression, or misbehave as `mode` says."""
    if mode == "raise":
        raise RuntimeError("kaput")
    if mode == "hang":
        time.sleep(3600)
    if mode == "big":
        return "7" * (1 << 20)  # 1 MB
    return builtin_calculator(expression)


def again(messages, turns: int = 3):
    """An interaction playing the user: asks for another try until the conversation has `turns`
    assistant turns, rewarding each turn 0.5."""
    said = sum(m["role"] == "assistant" for m in messages)
    if said >= turns:
        return {"content": None, "done": True, "reward": 1.0}
    return {"content": "Try again", "reward": 0.5}
