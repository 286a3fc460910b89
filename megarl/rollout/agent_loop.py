"""Multi-turn, tool-using rollouts (`generation.producer=agent`): a SampleProducer that drives
many conversations through a streaming engine at once.

A conversation generates until its turn ends; a turn with tool calls (tool_calls.py) runs them in
the tool pool (worker processes, each call within a timeout) and the next turn starts when its
results are in, while the engine keeps generating the other conversations' turns (nothing waits in
lockstep). A turn without calls ends the conversation, or, with an interaction configured, the
interaction (`module:function(messages, **interaction_kwargs)`, run in the same pool) answers as
the user or the environment: a text, or {"content": text or None, "reward": float, "done": bool}.

Token exactness: a sample's response is the exact ids the engine generated, turn by turn, with
the exact ids inserted between turns (chat_insert.py: template text and tool outputs tokenized on
their own, never the decoded conversation again); the loss mask is 1 on generated ids and 0 on
inserted ones, and each generated id keeps its sampling log-prob. Every turn is a new request for
the whole conversation so far (the engine's prefix cache serves the repeated prefix).

Limits: `max_turns` assistant turns, `sampling.max_new_tokens` response tokens in all (generated
and inserted; a conversation that would pass it ends there, finish reason "length"), and
`max_tool_output_chars` per tool result (longer ones are cut, marked and counted). A tool that
raises, hangs or names no known tool gives a tool message saying so and a counted event.
Per record (verl's layout): `extra_info.tools_kwargs` {tool name: extra arguments, or verl's
{"create_kwargs": ..., "execute_kwargs": ...}} is added to each call's arguments (the record's
values win over the model's), `extra_info.interaction_kwargs` reaches the interaction, and
`extra_info.agent_name` "single_turn_agent" (verl's name; "single_turn" too) skips the tools for
that record; "tool_agent" or none uses them; any other name is refused.
"""

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megarl.plugins.worker_pool import Result, WorkerPool
from megarl.rollout.chat_insert import first_prompt_ids, inserted_ids
from megarl.rollout.engine import RolloutSample, SamplingConfig, sample_seed
from megarl.rollout.prompts import Prompt
from megarl.rollout.tool_calls import ParsedTurn, load_parser
from megarl.rollout.tools import load_tool, loaded_tools

EVENTS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_output_cut", "call_parse_errors",
          "interaction_errors", "budget_ends")
_TURN_SEED = 7919  # a later turn's seed moves on from the first's


@dataclass(frozen=True)
class AgentConfig:
    tools: Tuple[str, ...] = ()  # built-in (calculator, python) or module:function
    parser: str = "hermes"  # tool-call format: built-in or module:function
    interaction: str = ""  # module:function answering turns without tool calls ("": none)
    max_turns: int = 4  # assistant turns per conversation
    max_tool_output_chars: int = 4096
    tool_timeout_s: float = 30.0
    tool_workers: int = 4  # 0: tools run in the trainer process, one by one, no timeout

    def __post_init__(self):
        if self.max_turns < 1 or self.max_tool_output_chars < 1:
            raise ValueError(f"generation.agent.max_turns={self.max_turns} and max_tool_output_chars="
                             f"{self.max_tool_output_chars} must be >= 1")
        if self.tool_workers < 0 or self.tool_timeout_s <= 0:
            raise ValueError(f"generation.agent.tool_workers={self.tool_workers} must be >= 0 and "
                             f"tool_timeout_s={self.tool_timeout_s} > 0")


@dataclass
class _Conversation:
    prompt: Prompt
    prompt_index: int
    sampling: SamplingConfig  # n=1, this sample's seed
    prompt_ids: List[int]
    messages: List[Dict[str, Any]]  # the trajectory: the prompt's, then every turn's
    use_tools: bool
    response: List[int] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    events: Counter = field(default_factory=Counter)
    answers: List[Optional[Dict[str, Any]]] = field(default_factory=list)  # this turn's new messages
    waiting: Dict[int, Tuple[int, str]] = field(default_factory=dict)  # pool job -> (answer slot, kind)
    last_turn: List[int] = field(default_factory=list)  # the ids the engine generated last
    stop: bool = False  # the interaction ended the conversation
    finish_reason: str = ""

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def sample(self) -> RolloutSample:
        return RolloutSample(self.prompt_ids, self.response, torch.tensor(self.logprobs, dtype=torch.float32),
                             self.prompt_index, self.finish_reason,
                             response_mask=torch.tensor(self.mask, dtype=torch.float32),
                             trajectory=self.messages, events={name: self.events[name] for name in EVENTS})


def _tool_message(name: str, text: str) -> Dict[str, Any]:
    return {"role": "tool", "name": name, "content": text}


class AgentLoop:
    def __init__(self, tokenizer, config: AgentConfig):
        self.tokenizer, self.config = tokenizer, config
        self.parse = load_parser(config.parser)
        loaded = [load_tool(key)[0] for key in config.tools]
        self.tools = {tool.name: tool for tool in loaded}
        if len(self.tools) != len(loaded):
            raise ValueError(f"generation.agent.tools={list(config.tools)} name one tool twice")
        self.schemas = [tool.schema for tool in loaded] or None
        preload = [tool.key for tool in loaded] + ([config.interaction] if config.interaction else [])
        self.pool = WorkerPool("megarl.rollout.tool_worker", loaded_tools, config.tool_workers,
                               config.tool_timeout_s, preload)

    def produce(self, engine, prompts: Sequence[Prompt], sampling: SamplingConfig) -> List[RolloutSample]:
        conversations = []
        for index, prompt in enumerate(prompts):
            use_tools = bool(self.tools) and uses_tools(prompt.extra_info.get("agent_name"))
            opening = first_prompt_ids(self.tokenizer, prompt.messages, self.schemas if use_tools else None)
            for j in range(sampling.n):
                seed = sample_seed(sampling, index, j)
                conversations.append(_Conversation(prompt, index, replace(sampling, n=1, seed=seed), opening,
                                                   list(prompt.messages), use_tools))
        live: Dict[str, _Conversation] = {}  # engine request -> its conversation
        jobs: Dict[int, _Conversation] = {}  # pool job -> its conversation
        ready = list(conversations)  # conversations whose next turn can be generated
        while ready or live or jobs:
            for c in ready:
                self._next_turn(c, engine, live)
            ready = []
            if live:
                for progress in engine.step():
                    if progress.finished:
                        c = live.pop(progress.request_id)
                        self._turn_ended(c, progress, jobs)
                        ready += [c] if c.answers and not c.waiting else []
            for job, result in self.pool.poll(0.0 if live or ready else 0.05):
                c = jobs.pop(job)
                slot, kind = c.waiting.pop(job)
                c.answers[slot] = (self._tool_answer(c, c.answers[slot], result) if kind == "tool"
                                   else self._interaction_answer(c, result))
                ready += [] if c.waiting else [c]
        return [c.sample() for c in conversations]

    def _next_turn(self, c: _Conversation, engine, live: Dict[str, _Conversation]) -> None:
        """Insert this turn's answers (none before the first turn) and generate the next turn, or
        end the conversation where the answers or the budget say so."""
        answers, c.answers = [a for a in c.answers if a is not None], []
        if c.events["turns"]:
            if c.stop:
                c.messages += answers
                c.finish_reason = "stop"
                return
            ids = inserted_ids(self.tokenizer, c.last_turn, [_rendered(a) for a in answers],
                               self.schemas if c.use_tools else None)
            c.messages += answers
            if len(c.response) + len(ids) >= c.sampling.max_new_tokens:  # no token left to generate
                c.events["budget_ends"] += 1
                c.finish_reason = "length"
                return
            c.response += ids
            c.mask += [0] * len(ids)
            c.logprobs += [0.0] * len(ids)
        turn = c.events["turns"]
        seed = None if c.sampling.seed is None else c.sampling.seed + _TURN_SEED * turn
        request_id = f"c{id(c)}-t{turn}"
        live[request_id] = c
        budget = c.sampling.max_new_tokens - len(c.response)
        engine.submit(request_id, c.prompt_ids + c.response,
                      replace(c.sampling, max_new_tokens=budget, seed=seed))

    def _turn_ended(self, c: _Conversation, progress, jobs: Dict[int, _Conversation]) -> None:
        c.last_turn = list(progress.token_ids)
        c.response += progress.token_ids
        c.mask += [1] * len(progress.token_ids)
        c.logprobs += progress.logprobs
        c.events["turns"] += 1
        text = self.tokenizer.decode(progress.token_ids, skip_special_tokens=True)
        parsed = self.parse(text) if c.use_tools else ParsedTurn(text)
        c.messages.append({"role": "assistant", "content": parsed.content, "tool_calls": [
            {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in parsed.calls]})
        acts = bool(parsed.calls or parsed.errors or self.config.interaction)
        if progress.finish_reason == "length":
            c.finish_reason = "length"
        elif not acts:
            c.finish_reason = progress.finish_reason or "stop"
        elif c.events["turns"] >= self.config.max_turns:
            c.finish_reason = "max_turns"
        elif parsed.calls or parsed.errors:
            self._call_tools(c, parsed, jobs)
        else:
            job = self.pool.submit((self.config.interaction, ("interaction", (
                [_rendered(m) for m in c.messages], c.prompt.extra_info.get("interaction_kwargs", {})))))
            c.answers, c.waiting, jobs[job] = [None], {job: (0, "interaction")}, c

    def _call_tools(self, c: _Conversation, parsed: ParsedTurn, jobs: Dict[int, _Conversation]) -> None:
        c.events["call_parse_errors"] += len(parsed.errors)
        c.answers = [_tool_message("error", f"Error: {error}") for error in parsed.errors]
        extra = c.prompt.extra_info.get("tools_kwargs", {})
        for call in parsed.calls:
            c.events["tool_calls"] += 1
            tool = self.tools.get(call.name)
            if tool is None:
                c.events["tool_errors"] += 1
                c.answers.append(_tool_message(call.name, f"Error: no tool {call.name!r}; the tools are "
                                                          f"{sorted(self.tools)}"))
                continue
            arguments = {**call.arguments, **record_kwargs(extra, call.name)}
            job = self.pool.submit((tool.key, ("tool", arguments)))
            c.waiting[job] = (len(c.answers), "tool")
            c.answers.append(_tool_message(call.name, ""))  # its text when the result comes
            jobs[job] = c

    def _tool_answer(self, c: _Conversation, placeholder: Dict[str, Any], result: Result) -> Dict[str, Any]:
        if result.value is None:
            c.events["tool_timeouts" if result.timed_out else "tool_errors"] += 1
            return {**placeholder, "content": f"Error: {result.error}"}
        text, limit = result.value, self.config.max_tool_output_chars
        if len(text) > limit:
            c.events["tool_output_cut"] += 1
            text = f"{text[:limit]}\n[output cut at {limit} characters]"
        return {**placeholder, "content": text}

    def _interaction_answer(self, c: _Conversation, result: Result) -> Optional[Dict[str, Any]]:
        """The interaction's next user turn (its reward kept on the message), or None when it ends
        the conversation."""
        reply = result.value
        if reply is None:
            c.events["interaction_errors"] += 1
            c.stop = True
            return {"role": "user", "content": f"Error: {result.error}", "reward": 0.0}
        if isinstance(reply, str):
            reply = {"content": reply}
        content = reply.get("content")
        c.stop = bool(reply.get("done")) or content is None
        return {"role": "user", "content": content or "", "reward": float(reply.get("reward", 0.0))}

    def close(self) -> None:
        self.pool.close()


AGENT_NAMES = {None: True, "tool_agent": True, "single_turn_agent": False, "single_turn": False}
_VERL_TOOL_KWARGS = {"create_kwargs", "execute_kwargs"}


def uses_tools(agent_name) -> bool:
    if agent_name not in AGENT_NAMES:
        raise ValueError(f"extra_info.agent_name={agent_name!r}: megarl's agent loop knows "
                         f"{sorted(n for n in AGENT_NAMES if n)} (verl's names); fix the record")
    return AGENT_NAMES[agent_name]


def record_kwargs(tools_kwargs: Dict[str, Any], name: str) -> Dict[str, Any]:
    """A record's extra arguments for tool `name`: as given, or verl's create/execute kwargs merged."""
    given = tools_kwargs.get(name, {})
    if given and set(given) <= _VERL_TOOL_KWARGS:
        return {**given.get("create_kwargs", {}), **given.get("execute_kwargs", {})}
    return given


def _rendered(message: Dict[str, Any]) -> Dict[str, Any]:
    """What a chat template sees of a trajectory message (no reward)."""
    return {k: v for k, v in message.items() if k != "reward"}
