"""An environment as agentic workloads have them (bench_agent.py): an interaction whose
conversations last an uneven number of turns and whose steps are mostly quick, with a long tail of
slow ones (a sandbox build, a web request)."""

import time

QUICK_S, SLOW_S = 0.05, 2.0


def step(messages, turns: int, slow_turns=(), quick_s: float = QUICK_S, slow_s: float = SLOW_S):
    """Answer the assistant's turn: "Go on" until the conversation has `turns` assistant turns;
    the turns listed in `slow_turns` take `slow_s`, the others `quick_s`."""
    said = sum(m["role"] == "assistant" for m in messages)
    time.sleep(slow_s if said in slow_turns else quick_s)
    if said >= turns:
        return {"content": None, "done": True}
    return {"content": "Go on"}
