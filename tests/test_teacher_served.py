"""The served distillation teacher (megarl/teacher/served.py) against a real vLLM server on the
demo model, started once for the module by the code the run uses (teacher.serve): its log-probs
against transformers' and the colocated teacher's, its refusals before any step, and a run whose
teacher dies mid-run failing that step and resuming from its last checkpoint."""

import json
import os
import re
import signal
import time

import pytest

from tests.launch import finish, in_background, one_rank_env, run, start

VOCAB = 48  # the demo model's
MAX_LEN = 40  # the longest sequence the module's server scores (tests/workers/teacher_scores.py)


def _writing_to(log_path) -> list:
    """The processes whose stdout is log_path: a server started by megarl and what it started."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if os.readlink(f"/proc/{process.pid}/fd/1") == str(log_path):
                found.append(process)
        except OSError:
            continue
    return found


DYING = "test_a_teacher_dying_mid_run_fails_the_step_and_the_run_resumes"


def _run_args(demo_inputs, run_dir, *teacher):
    return ("--config", "configs/demo_cpu.yaml", f"run_dir={run_dir}",
            f"model.hf_dir={demo_inputs / 'model'}", f"model.megatron_dir={demo_inputs / 'megatron'}",
            f"data.path={demo_inputs / 'train.jsonl'}", "layout.world_size=1", "layout.ep=1", "steps=3",
            "data.prompts_per_step=8", "algo.advantage=grpo", "algo.reward=none", "algo.distill.coeff=1.0",
            "actor.router_replay=off", "checkpoint.every=1", "checkpoint.export_hf=false", *teacher)


def _run_killing_its_teacher(demo_inputs, run_dir):
    """A 3-step run with teacher.serve=true whose server (and its engine) is SIGKILLed once the
    step-1 checkpoint exists; what the run returned."""
    log = run_dir / "teacher_server.log"
    launch = start("scripts/train_ppo_moe.py", *_run_args(demo_inputs, run_dir, "teacher.serve=true",
                                                          f"teacher.hf_dir={demo_inputs / 'model'}"),
                   timeout=900, check=False, env=one_rank_env())
    deadline = time.monotonic() + 900
    while not (run_dir / "checkpoints" / "step_000001").is_dir():
        assert not launch.done(), launch.result().stderr[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    server = _writing_to(log)
    assert any("vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()) for p in server)
    for process in server:
        os.kill(process.pid, signal.SIGKILL)
    return finish(launch)[0]


@pytest.fixture(scope="module")
def killed_run(request, demo_inputs, tmp_path_factory):
    """(run_dir, a Future of _run_killing_its_teacher's result), begun at once when the test that
    reads it is selected, so that its launch and the module's server start side by side."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    selected = any(getattr(item, "originalname", item.name) == DYING and item.module is request.module
                   for item in request.session.items)
    future = in_background(_run_killing_its_teacher, demo_inputs, run_dir) if selected else None
    yield run_dir, future
    if future is not None:
        finish(future)


@pytest.fixture(scope="module")
def served(killed_run, demo_inputs, tmp_path_factory):
    """A ServedTeacher on the demo model, its server started as teacher.serve starts it; after the
    module, its shutdown must leave none of the server's processes."""
    from megarl.teacher.served import ServedTeacher

    log = tmp_path_factory.mktemp("teacher_server") / "server.log"
    teacher = ServedTeacher.serve(str(demo_inputs / "model"), "float32", VOCAB, MAX_LEN, 60.0, str(log))
    assert _writing_to(log), "the server's processes write its log"
    yield teacher
    teacher.shutdown()
    assert not _writing_to(log), "shutdown left some of the server's processes running"


@pytest.fixture(scope="module")
def scores(served, demo_inputs, tmp_path_factory):
    """tests/workers/teacher_scores.py at 2 ranks: what each rank saved."""
    import torch

    out = tmp_path_factory.mktemp("teacher_scores")
    run("tests/workers/teacher_scores.py", "--url", served.url, "--hf-dir", str(demo_inputs / "model"),
        "--out-dir", str(out), "--max-len", str(MAX_LEN), nproc=2, timeout=600)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def test_token_scores_read_vllm_prompt_logprobs():
    """vLLM's reply format (checked by the live tests below): the first token has no entry, each
    later one a dict of the token and the top-1 (string ids); a tie with the top-1 counts."""
    from megarl.teacher.served import token_scores

    reply = [None, {"5": {"logprob": -2.5, "rank": 3}, "9": {"logprob": -0.5, "rank": 1}},
             {"9": {"logprob": -0.25, "rank": 1}},
             {"4": {"logprob": -1.0, "rank": 2}, "7": {"logprob": -1.0, "rank": 1}}]
    assert token_scores(reply, [1, 5, 9, 4]) == ([0.0, -2.5, -0.25, -1.0], [0.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="lack token 6"):
        token_scores(reply, [1, 6, 9, 4])
    with pytest.raises(ValueError, match="3 tokens"):
        token_scores(reply, [1, 5, 9])


def test_a_url_that_does_not_answer_is_refused():
    """Before anything is built, naming the url and the two fixes; no server needed."""
    from megarl.parallel_state.megatron_groups import free_port
    from megarl.teacher.served import ServedTeacher

    url = f"http://127.0.0.1:{free_port()}/v1"
    began = time.monotonic()
    with pytest.raises(ValueError, match="does not answer") as refused:
        ServedTeacher(url, VOCAB, MAX_LEN, timeout_s=60.0)
    assert url in str(refused.value) and "vllm serve" in str(refused.value) and "teacher.serve=true" in str(
        refused.value)
    assert time.monotonic() - began < 10


def test_served_logprobs_equal_transformers_and_the_colocated_teachers(scores, demo_inputs):
    """On the same checkpoint (fp32), every scored token's log-prob from the server equals
    transformers' (float64 log-softmax of its fp32 logits) and the colocated teacher's within 1e-4,
    and its top-1 flag equals transformers' argmax; rank 1 holds rank 0's numbers exactly (one rank
    asks, the scores are broadcast); column 0 and padding hold 0."""
    import torch
    import transformers

    from tests.workers.synthetic_batch import synthetic_batch

    batch = synthetic_batch(VOCAB, max_len=MAX_LEN)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_inputs / "model", dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch.tokens).logits.double()  # [N, L, V]; padding sits after each row's tokens
    scored = torch.arange(MAX_LEN)[None, :] < batch.lengths[:, None]
    scored[:, 0] = False
    expected = torch.zeros(batch.size, MAX_LEN, dtype=torch.float64)
    expected[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    top1 = torch.zeros(batch.size, MAX_LEN)
    top1[:, 1:] = (logits[:, :-1].argmax(-1) == batch.tokens[:, 1:]).float()
    logprobs, flags = scores[0]["served"]
    assert (logprobs[~scored] == 0).all() and (flags[~scored] == 0).all()
    assert (logprobs[scored].double() - expected[scored]).abs().max() < 1e-4
    assert torch.equal(flags[scored], top1[scored]) and 0 < flags[scored].sum() < scored.sum()
    colocated, colocated_top1 = scores[0]["colocated"]
    assert (logprobs[scored] - colocated[scored]).abs().max() < 1e-4
    assert torch.equal(flags[scored], colocated_top1[scored])
    for name in ("served", "colocated"):
        assert all(torch.equal(a, b) for a, b in zip(scores[0][name], scores[1][name]))


def test_refusals_reach_every_rank(scores):
    """A url that does not answer is refused on both ranks with rank 0's message; a server lost
    after the checks fails the scoring on both ranks, naming it and the resume."""
    dead = scores[0]["dead_url"]
    for rank in scores:
        assert rank["refused"] == scores[0]["refused"] and rank["refused"].startswith("ValueError")
        assert dead in rank["refused"] and "does not answer" in rank["refused"]
        assert rank["lost"] == scores[0]["lost"] and rank["lost"].startswith("RuntimeError")
        assert f"the served teacher at {dead} failed" in rank["lost"] and "--resume auto" in rank["lost"]


def test_a_vocabulary_or_context_that_differs_is_refused(served):
    """Probed on the live server: the student's last id refused (its vocabulary is smaller) or the
    next one scored (larger), each naming both sizes; a run whose sequences outgrow the server's
    max_model_len, naming both lengths."""
    from megarl.teacher.served import ServedTeacher

    with pytest.raises(ValueError, match=f"refuses token id {VOCAB}, .*vocab_size {VOCAB + 1}"):
        ServedTeacher(served.url, VOCAB + 1, MAX_LEN, timeout_s=60.0)
    with pytest.raises(ValueError, match=f"scores token id {VOCAB - 1}, .*vocab_size {VOCAB - 1}.* larger"):
        ServedTeacher(served.url, VOCAB - 1, MAX_LEN, timeout_s=60.0)
    with pytest.raises(ValueError, match=f"takes {MAX_LEN + 1} tokens.*reach {MAX_LEN + 1}.*{MAX_LEN + 2}"):
        ServedTeacher(served.url, VOCAB, MAX_LEN + 1, timeout_s=60.0)


def test_a_teacher_dying_mid_run_fails_the_step_and_the_run_resumes(killed_run, served, demo_inputs):
    """teacher.serve=true: the run starts its server; once the step-1 checkpoint exists the server
    is killed (SIGKILL, its engine too). The next step fails with an error naming the server's url
    and none of its processes is left; --resume auto with the module's server as teacher.url
    continues from the last checkpoint and scores the steps after it."""
    run_dir, future = killed_run
    failed = future.result()
    assert failed.returncode != 0
    assert "the served teacher at http://127.0.0.1:" in failed.stderr and "failed to score" in failed.stderr
    assert not (run_dir / "checkpoints" / "step_000003").exists()
    assert not _writing_to(run_dir / "teacher_server.log")
    resumed = run("scripts/train_ppo_moe.py", *_run_args(demo_inputs, run_dir, f"teacher.url={served.url}"),
                  "--resume", "auto", timeout=900, env=one_rank_env())
    said = re.search(r"resumed from \S+ \(step (\d+)\)", resumed.stdout + resumed.stderr)
    assert said and int(said.group(1)) in (1, 2), resumed.stdout[-2000:]
    with open(run_dir / "metrics.jsonl") as f:
        steps = {row["step"]: row for row in map(json.loads, f)}
    assert set(steps) == {1, 2, 3} and (run_dir / "checkpoints" / "step_000003").is_dir()
    for number in range(int(said.group(1)) + 1, 4):  # scored by the module's server after the resume
        assert -10 < steps[number]["distill/teacher_logprob"] < 0
        assert 0 < steps[number]["distill/teacher_top1_match"] <= 1
