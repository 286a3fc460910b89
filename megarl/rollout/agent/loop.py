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
the whole conversation so far (the engine's prefix cache serves the repeated prefix; an engine
that returns routing computes it again, and the last turn's routing is the whole sample's).
Streamed like every producer (producer.py): conversations of several draws at once, a weight
update between two engine steps continues (or restarts) the turns in the engine (turns.py) while
conversations waiting on tools wait on; each generated id keeps the policy version that sampled it.

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
from megarl.rollout.agent.chat_insert import first_prompt_ids, inserted_ids
from megarl.rollout.agent.sandbox import LIMITS
from megarl.rollout.agent.tool_calls import ParsedTurn, load_parser
from megarl.rollout.agent.tools import SANDBOXES, CodeSandbox, Tool, load_tool, loaded_tools
from megarl.rollout.draws import Draw, Draws
from megarl.rollout.engine import RolloutSample, SamplingConfig, sample_seed
from megarl.rollout.prompts import Prompt
from megarl.rollout.turns import Turn, TurnDriver

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
    # Where tools that run code (the built-in python) run it: local (bubblewrap on this machine,
    # rollout/agent/sandbox.py) or http (a SandboxFusion run_code endpoint, sandbox_http.py)
    sandbox: str = "local"
    sandbox_url: str = ""  # http: the endpoint, e.g. http://host:8080/run_code
    sandbox_timeout_s: float = 30.0  # http: one request's limit (the code's own is 20 s)
    sandbox_retries: int = 1  # http: a request with no answer or a 502-504 is sent again this often

    @property
    def code_sandbox(self) -> CodeSandbox:
        return CodeSandbox(self.sandbox, self.sandbox_url, self.sandbox_timeout_s, self.sandbox_retries)

    def __post_init__(self):
        if self.max_turns < 1 or self.max_tool_output_chars < 1:
            raise ValueError(f"generation.agent.max_turns={self.max_turns} and max_tool_output_chars="
                             f"{self.max_tool_output_chars} must be >= 1")
        if self.tool_workers < 0 or self.tool_timeout_s <= 0:
            raise ValueError(f"generation.agent.tool_workers={self.tool_workers} must be >= 0 and "
                             f"tool_timeout_s={self.tool_timeout_s} > 0")
        if self.sandbox not in SANDBOXES:
            raise ValueError(f"generation.agent.sandbox={self.sandbox!r}; choose one of {SANDBOXES}")
        if self.sandbox == "http" and not self.sandbox_url.startswith(("http://", "https://")):
            raise ValueError(f"generation.agent.sandbox=http needs sandbox_url, a run_code endpoint such as "
                             f"http://host:8080/run_code (got {self.sandbox_url!r})")
        if self.sandbox_timeout_s <= LIMITS.wall_s or self.sandbox_retries < 0:
            raise ValueError(f"generation.agent.sandbox_timeout_s={self.sandbox_timeout_s} must exceed the "
                             f"code's own limit of {LIMITS.wall_s:g} s, and sandbox_retries="
                             f"{self.sandbox_retries} be >= 0")


def load_tools(config: AgentConfig) -> List[Tool]:
    """The configured tools, each loaded, and the sandbox checked on this machine when one of them
    runs code: preflight calls it before any process starts, the agent loop again where the tools
    run (a machine where the sandbox cannot work is refused, naming what it lacks)."""
    tools = [load_tool(key)[0] for key in config.tools]
    if any(tool.runs_code for tool in tools):
        config.code_sandbox.check()
    return tools


@dataclass(eq=False)
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
    versions: List[int] = field(default_factory=list)  # -1 on inserted ids
    events: Counter = field(default_factory=Counter)
    answers: List[Optional[Dict[str, Any]]] = field(default_factory=list)  # this turn's new messages
    waiting: Dict[int, Tuple[int, str]] = field(default_factory=dict)  # job -> (answer slot, kind)
    turn: Optional[Turn] = None  # the last turn submitted
    stop: bool = False  # the interaction ended the conversation
    finish_reason: str = ""

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def live_turn(self) -> Optional[Turn]:
        return self.turn if self.turn is not None and not self.turn.done else None

    def sample(self, versions: bool) -> RolloutSample:
        # The last turn's request fed the whole conversation but its last id (a conversation ends
        # after a generated turn, or before inserting ids it would not have room to answer), so its
        # routing is every fed id's, computed by the weights that finished the conversation.
        return RolloutSample(self.prompt_ids, self.response, torch.tensor(self.logprobs, dtype=torch.float32),
                             self.prompt_index, self.finish_reason,
                             routed_experts=self.turn.routed_experts if self.turn is not None else None,
                             versions=torch.tensor(self.versions, dtype=torch.int64) if versions else None,
                             response_mask=torch.tensor(self.mask, dtype=torch.float32),
                             trajectory=self.messages, events={name: self.events[name] for name in EVENTS})


def _tool_message(name: str, text: str) -> Dict[str, Any]:
    return {"role": "tool", "name": name, "content": text}


class AgentLoop(Draws[_Conversation]):
    """A streaming SampleProducer (producer.py). On an engine of several ranks every rank runs the
    same conversations and submits the same turns; only the engine leader runs tools and
    interactions, in its pool, and each step tells the other ranks which finished with what
    (TurnDriver.from_leader), so a tool's timeout on one rank cannot make the ranks diverge."""

    def __init__(self, tokenizer, config: AgentConfig):
        super().__init__()
        self.tokenizer, self.config = tokenizer, config
        self.parse = load_parser(config.parser)
        loaded = load_tools(config)
        self.tools = {tool.name: tool for tool in loaded}
        if len(self.tools) != len(loaded):
            raise ValueError(f"generation.agent.tools={list(config.tools)} name one tool twice")
        self.schemas = [tool.schema for tool in loaded] or None
        self._preload = [tool.key for tool in loaded] + ([config.interaction] if config.interaction else [])
        self._pool: Optional[WorkerPool] = None  # the engine leader's, made at its first job
        self._ready: List[_Conversation] = []  # whose next turn can be generated
        self._turns: Dict[int, _Conversation] = {}  # id(turn in the engine) -> its conversation
        self._jobs: Dict[int, _Conversation] = {}  # job -> its conversation
        self._pool_jobs: Dict[int, int] = {}  # the leader's: its pool's job -> job
        self._submitted_jobs = 0

    def start(self, driver: TurnDriver, draw: Draw, prompts: Sequence[Prompt],
              sampling: SamplingConfig) -> None:
        conversations = []
        for index, prompt in enumerate(prompts):
            use_tools = bool(self.tools) and uses_tools(prompt.extra_info.get("agent_name"))
            opening = first_prompt_ids(self.tokenizer, prompt.messages, self.schemas if use_tools else None)
            for j in range(sampling.n):
                seed = sample_seed(sampling, index, j)
                conversations.append(_Conversation(prompt, index, replace(sampling, n=1, seed=seed), opening,
                                                   list(prompt.messages), use_tools))
        self._add(draw, conversations)
        self._ready += conversations

    def step(self, driver: TurnDriver) -> None:
        """Submit the turns that can go, one engine step, and the tool and interaction results in
        (waiting up to 50 ms for one when nothing is in the engine)."""
        ready, self._ready = self._ready, []
        for c in ready:
            self._next_turn(c, driver)
        if driver.busy():
            for turn in driver.step():
                c = self._turns.pop(id(turn))
                self._turn_ended(c, turn, driver)
                if c.answers and not c.waiting:
                    self._ready.append(c)
        wait = 0.0 if driver.busy() or self._ready else 0.05
        for job, result in driver.from_leader(lambda: self._poll(driver, wait)):
            c = self._jobs.pop(job)
            slot, kind = c.waiting.pop(job)
            c.answers[slot] = (self._tool_answer(c, c.answers[slot], result) if kind == "tool"
                               else self._interaction_answer(c, result))
            if not c.waiting:
                self._ready.append(c)

    def drop(self, driver: TurnDriver, draw: Draw) -> List[_Conversation]:
        """A dropped conversation's tool jobs still finish (a worker cannot be told to stop one);
        their results are then ignored."""
        dropped = super().drop(driver, draw)
        gone = set(dropped)
        self._ready = [c for c in self._ready if c not in gone]
        self._turns = {key: c for key, c in self._turns.items() if c not in gone}
        self._jobs = {job: c for job, c in self._jobs.items() if c not in gone}
        return dropped

    def _submit_job(self, driver: TurnDriver, c: _Conversation, job_spec) -> int:
        """A tool or interaction job for conversation `c`: numbered alike on every rank, run by
        the engine leader alone."""
        job, self._submitted_jobs = self._submitted_jobs, self._submitted_jobs + 1
        self._jobs[job] = c
        if driver.engine.placement.leader:
            self._pool_jobs[self.pool().submit(job_spec)] = job
        return job

    def pool(self) -> WorkerPool:
        """The tool and interaction workers (the engine leader's; made at first use)."""
        if self._pool is None:
            self._pool = WorkerPool("megarl.rollout.agent.tool_worker", loaded_tools,
                                    self.config.tool_workers, self.config.tool_timeout_s, self._preload)
        return self._pool

    def _poll(self, driver: TurnDriver, wait: float) -> List[Tuple[int, Result]]:
        """The leader's: (job, result) of the jobs finished since the last poll, those of dropped
        conversations left out."""
        if self._pool is None:
            return []
        done = [(self._pool_jobs.pop(pool_job), result) for pool_job, result in self._pool.poll(wait)]
        return [(job, result) for job, result in done if job in self._jobs]

    def _next_turn(self, c: _Conversation, driver: TurnDriver) -> None:
        """Insert this turn's answers (none before the first turn) and generate the next turn, or
        end the conversation where the answers or the budget say so."""
        answers, c.answers = [a for a in c.answers if a is not None], []
        if c.events["turns"]:
            if c.stop:
                c.messages += answers
                c.finish_reason = "stop"
                return
            ids = inserted_ids(self.tokenizer, c.turn.tokens, [_rendered(a) for a in answers],
                               self.schemas if c.use_tools else None)
            c.messages += answers
            if len(c.response) + len(ids) >= c.sampling.max_new_tokens:  # no token left to generate
                c.events["budget_ends"] += 1
                c.finish_reason = "length"
                return
            c.response += ids
            c.mask += [0] * len(ids)
            c.logprobs += [0.0] * len(ids)
            c.versions += [-1] * len(ids)
        turn = c.events["turns"]
        seed = None if c.sampling.seed is None else c.sampling.seed + _TURN_SEED * turn
        budget = c.sampling.max_new_tokens - len(c.response)
        c.turn = Turn(c.prompt_ids + c.response, replace(c.sampling, max_new_tokens=budget, seed=seed))
        self._turns[id(c.turn)] = c
        driver.submit(c.turn)

    def _turn_ended(self, c: _Conversation, turn: Turn, driver: TurnDriver) -> None:
        c.response += turn.tokens
        c.mask += [1] * len(turn.tokens)
        c.logprobs += turn.logprobs
        c.versions += turn.versions
        c.events["turns"] += 1
        text = self.tokenizer.decode(turn.tokens, skip_special_tokens=True)
        parsed = self.parse(text) if c.use_tools else ParsedTurn(text)
        c.messages.append({"role": "assistant", "content": parsed.content, "tool_calls": [
            {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in parsed.calls]})
        acts = bool(parsed.calls or parsed.errors or self.config.interaction)
        if turn.finish_reason == "length":
            c.finish_reason = "length"
        elif not acts:
            c.finish_reason = turn.finish_reason or "stop"
        elif c.events["turns"] >= self.config.max_turns:
            c.finish_reason = "max_turns"
        elif parsed.calls or parsed.errors:
            self._call_tools(c, parsed, driver)
        else:
            c.answers = [None]
            job = self._submit_job(driver, c, (self.config.interaction, ("interaction", (
                [_rendered(m) for m in c.messages], c.prompt.extra_info.get("interaction_kwargs", {})))))
            c.waiting = {job: (0, "interaction")}

    def _call_tools(self, c: _Conversation, parsed: ParsedTurn, driver: TurnDriver) -> None:
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
            job = self._submit_job(driver, c, (tool.key, ("tool", (arguments, self.config.code_sandbox))))
            c.waiting[job] = (len(c.answers), "tool")
            c.answers.append(_tool_message(call.name, ""))  # its text when the result comes

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
        if self._pool is not None:
            self._pool.close()


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
