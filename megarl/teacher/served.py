"""A teacher behind an OpenAI-compatible server (vLLM's /v1/completions): each sequence, as token
ids, is sent as a prompt with `prompt_logprobs: 1` and max_tokens 1; the reply gives every prompt
token its log-prob under the teacher and the teacher's top-1 token at that position.

Rank 0 alone talks to the server and broadcasts the scores (and any failure) to the other trainer
ranks: every rank holds the whole batch anyway, so splitting the rows over data-parallel ranks
would only multiply connections to one server whose throughput is the limit; one client also
gives every rank the same error, at the same step, instead of some ranks waiting in a collective
for others that failed. Rank 0's requests go out concurrently.

Owns asking the server, the checks before the first step (it answers, with the student's
vocabulary, long enough sequences) and turning a failure into one error on every rank. Does not
own starting the server (server.py) nor the distillation term (algos/distill.py).
"""

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from megarl.batch.rollout_batch import RolloutBatch
from megarl.parallel_state import megatron_groups
from megarl.teacher.server import VllmServer

ROWS_PER_REQUEST = 16  # sequences per /completions request (vLLM batches them into one step)
CONCURRENT_REQUESTS = 8  # requests in flight: keeps the server's batch full while replies travel
T = TypeVar("T")


def token_scores(prompt_logprobs: Sequence[Optional[dict]],  # one per token; vLLM's first is None
                 tokens: Sequence[int]) -> Tuple[List[float], List[float]]:
    """One sequence's log-probs and top-1 flags, column 0 zero, from vLLM's prompt_logprobs: for
    each later token a dict {token id (as a string): {"logprob": ..., "rank": ...}} holding that
    token and, with prompt_logprobs 1, the teacher's most likely one. A tie with the most likely
    counts as top-1, as the colocated teacher's top1_match does. Pure."""
    if len(prompt_logprobs) != len(tokens):
        raise ValueError(f"the server returned {len(prompt_logprobs)} prompt log-probs for a sequence "
                         f"of {len(tokens)} tokens")
    logprobs, top1 = [0.0], [0.0]
    for token, entry in zip(tokens[1:], prompt_logprobs[1:]):
        if not entry or str(token) not in entry:
            raise ValueError(f"the server's prompt_logprobs lack token {token} at its position: {entry}")
        own = float(entry[str(token)]["logprob"])
        logprobs.append(own)
        top1.append(float(own >= max(float(e["logprob"]) for e in entry.values())))
    return logprobs, top1


def _post(url: str, body: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as error:  # the server's own message says why
        said = error.read().decode(errors="replace")[:500]
        raise RuntimeError(f"HTTP {error.code} from {url}: {said}") from None


def _on_rank0(compute: Callable[[], T], failure: Callable[[Exception], Exception]) -> Optional[T]:
    """compute() on rank 0: its result there, None on the other ranks. When it raises, every rank
    raises failure(what it raised), made on rank 0 (which alone knows the server). Collective (a
    world of one without torch.distributed)."""
    result, error = None, None
    if megatron_groups.is_rank0():
        try:
            result = compute()
        except Exception as raised:  # noqa: BLE001 -- any failure must reach the other ranks too
            error = failure(raised)
            if error is not raised:
                error.__cause__ = raised
    said = [None if error is None else (type(error), str(error))]
    if dist.is_initialized():
        dist.broadcast_object_list(said, src=0)
    if error is not None:
        raise error
    if said[0] is not None:
        kind, message = said[0]
        raise kind(message)
    return result


def _broadcast(values: Optional[torch.Tensor], shape: Tuple[int, ...]) -> torch.Tensor:
    """Rank 0's float32 `values` of `shape` on every rank. Collective."""
    if not dist.is_initialized():
        return values
    device = megatron_groups.device()
    out = values.to(device) if values is not None else torch.zeros(shape, dtype=torch.float32, device=device)
    dist.broadcast(out, src=0)
    return out.cpu()


class ServedTeacher:
    """A served teacher at `url` (an OpenAI base, http://host:port/v1), checked on construction:
    it answers, its vocabulary is the student's (`vocab_size`) and it takes sequences of max_len
    tokens. `server`: the run's own (teacher.serve), stopped at shutdown. Collective."""

    def __init__(self, url: str, vocab_size: int, max_len: int, timeout_s: float,
                 server: Optional[VllmServer] = None):
        self.url, self.timeout_s, self.server = url.rstrip("/"), timeout_s, server
        self.model = ""  # the served model's name, from its /models
        try:
            _on_rank0(lambda: self._check(vocab_size, max_len), lambda raised: raised)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def serve(cls, hf_dir: str, dtype: str, vocab_size: int, max_len: int, timeout_s: float,
              log_path: str) -> "ServedTeacher":
        """Start vLLM's server on hf_dir from rank 0, wait until it answers, and check it as a URL
        given. The other ranks never talk to it. Collective."""
        def start() -> VllmServer:
            server = VllmServer(hf_dir, dtype, max_len + 1, log_path)
            server.wait()
            return server

        server = _on_rank0(start, lambda raised: raised)
        return cls(server.url if server is not None else "", vocab_size, max_len, timeout_s, server)

    def _check(self, vocab_size: int, max_len: int) -> None:
        """The refusals before the first step (raised on rank 0; _from_rank0 tells the rest)."""
        try:
            with urllib.request.urlopen(f"{self.url}/models", timeout=min(self.timeout_s, 30.0)) as reply:
                models = json.load(reply)["data"]
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"teacher.url={self.url!r} does not answer ({error}): start an OpenAI-"
                             "compatible server on the teacher (vllm serve HF_DIR) and give its base URL "
                             "(http://HOST:PORT/v1), or set teacher.serve=true with teacher.hf_dir") from None
        self.model = models[0]["id"]
        served_len = models[0].get("max_model_len")  # vLLM's; another server may not say
        if served_len is not None and served_len < max_len + 1:
            raise ValueError(f"the teacher at {self.url} (model {self.model!r}) takes {served_len} tokens, "
                             f"but the run's sequences reach {max_len} (data.max_prompt_len + generation."
                             f"max_new_tokens) and scoring one generates a token: serve it with "
                             f"--max-model-len {max_len + 1} or more")
        # The student's highest token id must be scored, and the next one refused (vLLM refuses ids
        # past the larger of its model's vocabulary and its tokenizer's): the same vocabulary size.
        try:
            self._score([[0, vocab_size - 1]])
        except RuntimeError as error:
            raise ValueError(f"the teacher at {self.url} (model {self.model!r}) refuses token id "
                             f"{vocab_size - 1}, inside the student's vocabulary (vocab_size {vocab_size}): "
                             f"its vocabulary is smaller ({error}); distill from a teacher with the "
                             "student's tokenizer and vocabulary") from None
        try:
            self._score([[0, vocab_size]])
        except RuntimeError:
            return
        raise ValueError(f"the teacher at {self.url} (model {self.model!r}) scores token id {vocab_size}, "
                         f"past the student's vocabulary (vocab_size {vocab_size}): its vocabulary is "
                         "larger; distill from a teacher with the student's tokenizer and vocabulary")

    def _score(self, rows: List[List[int]]) -> List[Tuple[List[float], List[float]]]:
        """token_scores of each row, asked in one request."""
        body = {"model": self.model, "prompt": rows, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 1}
        reply = _post(f"{self.url}/completions", body, self.timeout_s)
        choices = sorted(reply["choices"], key=lambda choice: choice["index"])
        if len(choices) != len(rows) or any(c.get("prompt_logprobs") is None for c in choices):
            raise ValueError(f"the server answered {len(choices)} choices for {len(rows)} prompts, or "
                             "without prompt_logprobs (vLLM's /v1/completions returns them)")
        return [token_scores(c["prompt_logprobs"], row) for c, row in zip(choices, rows)]

    def _ask(self, batch: RolloutBatch) -> torch.Tensor:  # [N, L, 2]
        rows = [batch.tokens[n, :int(batch.lengths[n])].tolist() for n in range(batch.size)]
        chunks = [rows[i:i + ROWS_PER_REQUEST] for i in range(0, len(rows), ROWS_PER_REQUEST)]
        with ThreadPoolExecutor(min(CONCURRENT_REQUESTS, len(chunks))) as pool:
            scored = [row for chunk in pool.map(self._score, chunks) for row in chunk]
        both = torch.zeros(batch.size, batch.width, 2, dtype=torch.float32)
        for n, (logprobs, top1) in enumerate(scored):
            both[n, :len(logprobs), 0] = torch.tensor(logprobs)
            both[n, :len(top1), 1] = torch.tensor(top1)
        return both

    def logprobs(self, batch: RolloutBatch) -> RolloutBatch:
        """The batch with teacher_logprobs and teacher_top1 [N, L] filled on every rank; a server
        that fails (died, timed out) fails the step on every rank, naming it. Collective."""
        def failure(raised: Exception) -> RuntimeError:
            return RuntimeError(f"the served teacher at {self.url} failed to score this step's samples "
                                f"({type(raised).__name__}: {raised}): restart it (or the run, with "
                                "teacher.serve=true) and resume from the last checkpoint with --resume auto")

        both = _broadcast(_on_rank0(lambda: self._ask(batch), failure), (batch.size, batch.width, 2))
        return batch.with_fields(teacher_logprobs=both[..., 0], teacher_top1=both[..., 1])

    def shutdown(self) -> None:
        """Stop the run's own server (a URL given is left running)."""
        if self.server is not None:
            self.server.stop()
            self.server = None
