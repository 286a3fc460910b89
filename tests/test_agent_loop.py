"""The agent loop: tool-call parsing, the built-in tools and their sandbox, the tokens inserted
between turns, and multi-turn rollouts on real vLLM with a scripted tool-calling model: every
sample's token ids are the engine's generated ids and the inserted ids, byte for byte, the loss
mask 0 exactly on the inserted ones; tools that raise, hang or return 1 MB give tool messages
and counted events."""

import errno
import json
import socket
import subprocess
import sys

import pytest

from megarl.rollout.agent.chat_insert import assistant_close, inserted_text
from megarl.rollout.agent.tool_calls import ToolCall, hermes
from megarl.rollout.agent.tools import calculator, python, schema_of
from tests.launch import ROOT, last_json, one_rank_env, run, start
from tests.scripted_agent import PIECES, make_scripted_agent

# The tests that run the tool demo, on the inputs tool_demo_inputs makes once for both.
LEARNS = ("test_tool_demo_learns_to_call_the_calculator",
          "test_async_tool_demo_learns_on_a_rollout_engine_of_two_ranks")


@pytest.fixture(scope="module", autouse=True)
def tool_demo_inputs(request, tmp_path_factory):
    """(folder, its launch) of the tool demo's inputs, made as configs/demo_tools_cpu.yaml's header
    says (prepare_demo.py --task tools --hf-only: a 150-step warm start, over a minute of one
    core), begun with this module when its learning test is selected: the tests before it run
    mostly on one core, and the warm start takes the other."""
    if not any(item.module is request.module and item.name in LEARNS for item in request.session.items):
        return None
    inputs = tmp_path_factory.mktemp("tool_demo_inputs")
    return inputs, start("scripts/prepare_demo.py", "--task", "tools", "--hf-only", "--out", str(inputs))


def test_hermes_calls_are_parsed_and_bad_ones_named():
    turn = hermes('Let me add.<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
                  '</tool_call><tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}'
                  '\n</tool_call>')
    assert turn.content == "Let me add."
    assert turn.calls == [ToolCall("calculator", {"expression": "1+2"}), ToolCall("search", {"q": "x"})]
    assert not turn.errors
    bad = hermes('<tool_call>{"name": "x", "arguments": [1]}</tool_call><tool_call>{oops}</tool_call>'
                 '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "y"')
    assert bad.calls == []
    assert len(bad.errors) == 4
    assert "are not an object" in bad.errors[0] and "is not JSON" in bad.errors[1]
    assert 'has no "name"' in bad.errors[2] and bad.errors[3] == "a <tool_call> is not closed by </tool_call>"
    assert hermes("no calls here").calls == []


def test_calculator_is_exact_and_refuses_code():
    assert calculator("(12 + 7) * 3") == "57"
    assert calculator("123456789 * 987654321") == "121932631112635269"
    assert calculator("7 / 2") == "3.5" and calculator("2 ** 10") == "1024" and calculator("-4 // 3") == "-2"
    for bad, message in [("__import__('os')", "is not arithmetic"), ("9 ** 9 ** 9", "exponent"),
                         ("1 +", "is not an expression")]:
        with pytest.raises(ValueError, match=message):
            calculator(bad)


def test_schemas_come_from_the_attribute_or_the_signature():
    assert schema_of("calculator", calculator)["parameters"]["required"] == ["expression"]

    def lookup(city: str, days: int = 1) -> str:
        """Weather for a city.

        More text."""

    assert schema_of("m:lookup", lookup) == {
        "name": "lookup", "description": "Weather for a city.",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}

    def untyped(x):
        return x

    with pytest.raises(ValueError, match="parameter 'x' is not a str, int, float or bool"):
        schema_of("m:untyped", untyped)


# Connects to the test's listener and says so; the listener checks the token arrived. A machine
# without a network still has a loopback, so only the sandbox's own namespace can make this fail.
CONNECT = """import socket
try:
    with socket.create_connection(("127.0.0.1", {port}), timeout=2) as s:
        s.sendall(b"{token}")
    print("online")
except OSError as e:
    print("offline", e.errno)
"""


def _received(listener) -> bytes:
    """What one connection to `listener` sent, or b"" when none came within a second."""
    listener.settimeout(1)
    try:
        connection, _ = listener.accept()
    except socket.timeout:
        return b""
    with connection:
        connection.settimeout(5)
        return connection.recv(64)


def test_python_sandbox_runs_code_without_network():
    assert python("print(6 * 7)") == "42\n"
    assert "(exit code 1)" in python("raise SystemExit(1)")
    assert "MemoryError" in python("x = bytearray(4 << 30)")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        # The same program outside the sandbox reaches the listener: the check below can fail.
        outside = subprocess.run([sys.executable, "-I", "-c", CONNECT.format(port=port, token="outside")],
                                 capture_output=True, text=True, timeout=30)
        assert outside.stdout == "online\n", outside
        assert _received(listener) == b"outside"
        inside = python(CONNECT.format(port=port, token="inside"))
        # Its own network namespace has only a loopback of its own, where nothing listens
        # (tests/test_sandbox.py tries the rest of the network).
        assert inside == f"offline {errno.ECONNREFUSED}\n", inside
        assert _received(listener) == b""


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return make_scripted_agent(str(tmp_path_factory.mktemp("scripted_agent")))


def test_inserted_text_follows_the_template(scripted):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(scripted)
    end, call = PIECES.index("<|im_end|>"), PIECES.index(PIECES[8])
    assert assistant_close(tokenizer) == "<|im_end|>\n"
    tool = [{"role": "tool", "content": "5"}]
    # the model generated its end of turn: the rest of the close, then the tool turn and the prompt
    expected = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert inserted_text(tokenizer, [call, end], tool) == expected
    # it stopped without it (a stop string, the budget): the whole close
    assert inserted_text(tokenizer, [call], tool).startswith("<|im_end|>\n<|im_start|>tool\n")
    tokenizer.chat_template = "{{ messages[-1]['content'] }}"  # renders only the last turn
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        inserted_text(tokenizer, [end], tool)


@pytest.fixture(scope="module")
def rollouts(scripted):
    return last_json(run("tests/workers/agent_rollout.py", "--model-dir", scripted, env={"PYTHONPATH": ROOT}))


def _turns(sample, requests):
    """The engine requests of this sample's turns, in order: (prompt length, generated ids)."""
    full = sample["prompt_ids"] + sample["response_ids"]
    mine = {(len(r["prompt"]), tuple(r["generated"])) for r in requests
            if full[:len(r["prompt"]) + len(r["generated"])] == r["prompt"] + r["generated"]}
    return sorted(mine)


MODES = ["ok", "raise", "hang", "big", "single"]


def test_training_sequences_are_the_engines_ids_and_the_inserted_ids(scripted, rollouts):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(scripted)
    question = [{"role": "user", "content": "What is 2 + 3 ?"}]
    rendered = tokenizer.apply_chat_template(question, tools=rollouts["schemas"], tokenize=False,
                                             add_generation_prompt=True)
    opening = tokenizer.encode(rendered, add_special_tokens=False)
    for sample in rollouts["samples"]:
        assert sample["prompt_ids"] == opening
        full = sample["prompt_ids"] + sample["response_ids"]
        turns = _turns(sample, rollouts["requests"])
        tools = [m["content"] for m in sample["trajectory"] if m["role"] == "tool"]
        expected_mask, position = [], len(opening)
        for k, (prompt_length, generated) in enumerate(turns):
            assert prompt_length == position  # the request was the whole conversation so far
            expected_mask += [1] * len(generated)
            position += len(generated)
            if k + 1 < len(turns):  # what went in between: the tool turn as the template writes it
                inserted = full[position:turns[k + 1][0]]
                text = f"\n<|im_start|>tool\n{tools[k]}<|im_end|>\n<|im_start|>assistant\n"
                assert inserted == tokenizer.encode(text, add_special_tokens=False)
                expected_mask += [0] * len(inserted)
                position += len(inserted)
        assert position == len(full)
        assert sample["mask"] == expected_mask
        assert all(lp == 0.0 for lp, m in zip(sample["logprobs"], sample["mask"]) if m == 0)


def test_three_turns_with_tools_and_misbehaving_tools_become_messages(rollouts):
    samples = rollouts["samples"]
    assert [s["prompt_index"] for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    by_mode = {mode: samples[2 * i] for i, mode in enumerate(MODES)}
    for mode in ("ok", "raise", "hang", "big"):
        sample = by_mode[mode]
        assert sample["finish_reason"] == "max_turns" and sample["events"]["turns"] == 3
        assert sample["events"]["tool_calls"] == 2
        roles = [m["role"] for m in sample["trajectory"]]
        assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        call = sample["trajectory"][1]["tool_calls"][0]["function"]
        assert call == {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    said = {mode: by_mode[mode]["trajectory"][2]["content"] for mode in MODES[:4]}
    assert said["ok"] == "5"
    assert said["raise"] == "Error: RuntimeError: kaput" and by_mode["raise"]["events"]["tool_errors"] == 2
    assert said["hang"] == "Error: timed out after 2 s" and by_mode["hang"]["events"]["tool_timeouts"] == 2
    assert said["big"] == "7" * 100 + "\n[output cut at 100 characters]"
    assert by_mode["big"]["events"]["tool_output_cut"] == 2
    single = by_mode["single"]  # agent_name single_turn: no tools, the call is just text
    assert single["finish_reason"] == "stop" and single["events"]["turns"] == 1
    assert single["events"]["tool_calls"] == 0 and single["trajectory"][1]["tool_calls"] == []
    assert json.dumps(rollouts["schemas"]).count('"calculator"') == 1


def test_tool_demo_traces_call_insert_and_answer(tmp_path):
    """The tool demo's warm start: a tool trace is the call and its end, the result as the agent
    loop inserts it (out of the loss), then the answer; the call parses to the calculator's."""
    import transformers

    from megarl.demo.tool_task import tool_records, train_tool_tokenizer, warm_start_traces

    records = tool_records(50, seed=3)
    train_tool_tokenizer(records, str(tmp_path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    traces = warm_start_traces(records, tokenizer, seed=3)
    tool_traces = [(r, t) for r, t in zip(records, traces) if 0 in t[2]]
    assert 10 < len(tool_traces) < 40  # about half
    for record, (prompt, target, mask) in tool_traces:
        assert tokenizer.decode(prompt) == f"{record['prompt']} Answer:"
        first_end = target.index(tokenizer.eos_token_id)
        call = hermes(tokenizer.decode(target[:first_end], skip_special_tokens=True)).calls
        assert call == [ToolCall("calculator", {"expression": record["prompt"][8:-1]})]
        assert calculator(call[0].arguments["expression"]) == record["answer"]
        holes = [i for i, m in enumerate(mask) if m == 0]
        assert holes == list(range(first_end + 1, holes[-1] + 1))  # one run, right after the call
        # (a piece's decode drops its leading space)
        assert tokenizer.decode(target[holes[0]:holes[-1] + 1]) == f"Result: {record['answer']} Answer:"
        assert tokenizer.decode(target[holes[-1] + 1:], skip_special_tokens=True).strip() == record["answer"]


def test_records_choose_tools_as_verl_lays_them_out():
    from megarl.rollout.agent.loop import record_kwargs, uses_tools

    assert uses_tools(None) and uses_tools("tool_agent")
    assert not uses_tools("single_turn_agent") and not uses_tools("single_turn")
    with pytest.raises(ValueError, match="agent_name='react_agent'"):
        uses_tools("react_agent")
    assert record_kwargs({"calc": {"mode": "x"}}, "calc") == {"mode": "x"}
    verl = {"calc": {"create_kwargs": {"ground_truth": "5"}, "execute_kwargs": {"mode": "y"}}}
    assert record_kwargs(verl, "calc") == {"ground_truth": "5", "mode": "y"}
    assert record_kwargs(verl, "other") == {}


def test_tool_demo_learns_to_call_the_calculator(tool_demo_inputs, tmp_path):
    """configs/demo_tools_cpu.yaml itself, on inputs made as its header says (prepare_demo.py --task
    tools --hf-only), for its first 6 steps: GRPO finds out that calling the calculator pays. Steps
    5-6 are judged against the warm start untrained (actor.optim.lr=1e-12, seed 0): 64-77 tool calls
    of 128 conversations at every step, reward 0.45-0.54. Trained, seed 0 (this run) went 77 ->
    120.5 calls (mean of steps 5-6) and reward 0.54 -> 0.90. (Measured after every sample got a seed
    of its own, engine.sample_seed. Before, with seeds shared across prompts and shifted by one a
    step, the frozen run drifted from 21 to 74.5 calls, and seeds 0-3 trained reached 105.5-122.)"""
    (inputs, prepared), run_dir = tool_demo_inputs, tmp_path / "run"
    prepared.result()
    run("scripts/train_ppo_moe.py", "--config", "configs/demo_tools_cpu.yaml",
        f"model.hf_dir={inputs / 'model'}", f"data.path={inputs / 'train.jsonl'}", f"run_dir={run_dir}",
        "steps=6", "checkpoint.export_hf=false", timeout=900, env=one_rank_env())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    calls, rewards = [s["agent/tool_calls"] for s in steps], [s["reward/mean"] for s in steps]
    assert sum(calls[-2:]) / 2 >= 90, calls
    assert sum(rewards[-2:]) / 2 >= 0.65, rewards
    # Every generated token's log-prob is vLLM's, also in two-turn conversations (the result inserted).
    assert max(s["mismatch/logprob_diff_max"] for s in steps) < 1e-4


def test_async_tool_demo_learns_on_a_rollout_engine_of_two_ranks(tool_demo_inputs, tmp_path):
    """configs/demo_tools_async_cpu.yaml (the tool demo with the engine and the agent loop on ranks
    of their own, staleness 1, decoupled PPO with token IS) for its first 6 steps, its engine
    spanning two rollout ranks (rollout TP2: the leader runs the calculator and tells the other
    rank its results): it learns as the colocated demo does (same bars; seed 0 here went 74 ->
    113 calls of 128, steps 5-6, and reward 0.54 -> 0.84 with the engine on one rank), no sample
    is older than one version, and tokens the trainer's own weights sampled get their log-probs
    back exactly."""
    (inputs, prepared), run_dir = tool_demo_inputs, tmp_path / "run"
    prepared.result()
    run("scripts/train_ppo_moe.py", "--config", "configs/demo_tools_async_cpu.yaml",
        f"model.hf_dir={inputs / 'model'}", f"data.path={inputs / 'train.jsonl'}", f"run_dir={run_dir}",
        "steps=6", "checkpoint.export_hf=false", "layout.rollout_world_size=2", "layout.rollout_tp=2",
        nproc=3, timeout=900)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    calls, rewards = [s["agent/tool_calls"] for s in steps], [s["reward/mean"] for s in steps]
    assert sum(calls[-2:]) / 2 >= 90, calls
    assert sum(rewards[-2:]) / 2 >= 0.65, rewards
    assert all(s["async/sample_lag_max"] <= 1 for s in steps) and steps[-1]["agent/turns_mean"] > 1.5
    lag0 = [s["async/mismatch_lag0_max"] for s in steps if "async/mismatch_lag0_max" in s]
    assert lag0 and max(lag0) < 1e-4, lag0  # step 1 at least: version 0 on both sides
