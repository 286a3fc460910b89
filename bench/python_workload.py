"""bench_agent.py's real-work case: conversations whose every turn runs CPU-bound code in megarl's
python sandbox tool, tens to hundreds of milliseconds a call, uneven by conversation.

The demo model does not write tool calls, so `every_turn_calls_python` (the agent loop's parser)
reads each of its turns as one call to the python tool, and the code comes from the record's
extra_info.tools_kwargs, as verl's records give tools their arguments. Generation, the tool pool
and the sandbox are megarl's own; only the choice to call is scripted.
"""

import math
import random

from megarl.rollout.agent.tool_calls import ParsedTurn, ToolCall

# i*i % 7 over one period of 7; the sum of any range follows from it, so the output is checked
# without running the code a second time.
_SQUARES_MOD_7 = [i * i % 7 for i in range(7)]


def every_turn_calls_python(text: str) -> ParsedTurn:
    return ParsedTurn(text, [ToolCall("python", {})])


def code(iterations: int) -> str:
    """A pure-Python loop (no C kernel does the work for it), printing its result."""
    return f"print(sum(i * i % 7 for i in range({iterations})))"


def expected_output(iterations: int) -> str:
    periods, rest = divmod(iterations, 7)
    return f"{periods * sum(_SQUARES_MOD_7) + sum(_SQUARES_MOD_7[:rest])}\n"


def draw_iterations(count: int, seed: int, low: int = 300_000, high: int = 4_000_000):
    """Log-uniform loop lengths: on this machine's cores ~20-300 ms a call, most of them short."""
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(count)]
