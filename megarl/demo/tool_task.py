"""The tool demo's task, made locally: additions of three-digit numbers, which the tiny model
cannot do in its head but a calculator can, a sentencepiece tokenizer that spells the calculator's
calls, and the warm start's two kinds of traces.

The chat template (Hermes-like, compact): the question, " Answer:"; a tool result is rendered
" Result: 579 Answer:". A tool trace is
    What is 123 + 456? Answer: <tool_call>{"name": "calculator", "arguments": {"expression":
    "123 + 456"}}</tool_call></s> Result: 579 Answer: 579</s>
and a direct trace answers at once (" 579</s>"). The warm start teaches both, so rollouts start
with some calls and some guesses; the reward (math) is earned by calling the tool and copying its
result, which RL then has to find. Deterministic for a seed.
"""

import json
import random
from typing import Dict, List, Tuple

from megarl.demo.sentencepiece_tokenizer import train_sentencepiece

CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %} Result: {{ m['content'] }}"
                 "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %} Answer:{% endif %}")
LOW, HIGH = 100, 999


def tool_records(count: int, seed: int) -> List[Dict[str, str]]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        records.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    return records


def tool_call(record: Dict[str, str]) -> str:
    expression = record["prompt"][len("What is "):-1]
    return ("<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}})
            + "</tool_call>")


def train_tool_tokenizer(records: List[Dict[str, str]], out_dir: str, vocab_size: int = 128) -> None:
    """A BPE sentencepiece model over the task's traces (digits split), with <tool_call> and
    </tool_call> as single pieces, saved as an HF tokenizer folder."""
    lines = [f"{r['prompt']} Answer: {tool_call(r)} Result: {r['answer']} Answer: {r['answer']}"
             for r in records]
    train_sentencepiece(lines, out_dir, vocab_size, CHAT_TEMPLATE, symbols=("<tool_call>", "</tool_call>"),
                        normalization_rule_name="identity")


def warm_start_traces(records: List[Dict[str, str]], tokenizer, seed: int, tool_share: float = 0.5
                      ) -> List[Tuple[List[int], List[int], List[int]]]:
    """(prompt ids, target ids, loss mask over the target): a tool trace (the call, the tool's
    result inserted as the agent loop inserts it, masked out, then the answer) or a direct one."""
    from megarl.rollout.agent.chat_insert import first_prompt_ids, inserted_ids

    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    traces = []
    for record in records:
        prompt = first_prompt_ids(tokenizer, [{"role": "user", "content": record["prompt"]}])
        answer = tokenizer.encode(" " + record["answer"], add_special_tokens=False) + [eos]
        if rng.random() < tool_share:
            call = tokenizer.encode(" " + tool_call(record), add_special_tokens=False) + [eos]
            between = inserted_ids(tokenizer, call, [{"role": "tool", "content": record["answer"]}])
            traces.append((prompt, call + between + answer,
                           [1] * len(call) + [0] * len(between) + [1] * len(answer)))
        else:
            traces.append((prompt, answer, [1] * len(answer)))
    return traces
