"""The colocated distillation teacher (megarl/teacher/colocated.py) at a layout of its own, against
transformers on the same checkpoints, and its place in the memory plan and preflight.

One 2-rank launch (tests/workers/teacher_layout.py) holds the actor at TP1 x PP2 and, in the same
world, teachers under Megatron groups of their own: the student's checkpoint at TP2 (offloaded
between uses, scored twice), a teacher of another family (llama for the qwen3 student, the same
vocabulary) over both ranks as data parallel, a Qwen3-MoE teacher with its experts over both ranks
(EP2), and the student's checkpoint at the actor's layout.
The batch's responses are half the qwen3 model's greedy tokens, so the top-1 flags are not all 0.
"""

import contextlib
import json

import pytest
import torch

from megarl.algos.distill import distill_advantages, distill_metrics
from megarl.models.hf.config import arch_from_hf_config
from megarl.planning import flops, memory_plan
from megarl.planning.resolved import resolve
from megarl.teacher.build import teacher_dims
from megarl.teacher.config import TeacherConfig
from tests.launch import run
from tests.published_configs import QWEN3_30B_A3B, QWEN3_32B
from tests.test_presets import check_preset, load_preset
from tests.workers.synthetic_batch import synthetic_batch

TEACHERS = {"tp2": "qwen3", "other": "llama", "moe_ep2": "qwen3_moe"}  # the worker's, and their checkpoints
MAX_LEN = 48  # the worker's synthetic_batch(vocab, max_len=48)
QWEN = "qwen3_30b_a3b_gpu.yaml"  # a GPU preset at 32 GPUs of 80 GB (tests/test_presets.py)


@contextlib.contextmanager
def one_thread():
    """transformers' tiny forwards in this process, one thread: with two, OpenMP's waiting under the
    suite's load cost 50x their work (half_greedy: 13.8 s of CPU, 0.24 s with one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def transformers_reference(hf_dir: str, tokens: torch.Tensor, lengths: torch.Tensor):
    """(log-probs, top-1 flags) [N, L] of each row's tokens under transformers in fp32: column i
    for token i given the tokens before it, column 0 zero."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    logprobs, top1 = torch.zeros(tokens.shape), torch.zeros(tokens.shape)
    with torch.no_grad():
        for row, (ids, n) in enumerate(zip(tokens, lengths.tolist())):
            logits = model(ids[None, :n]).logits[0, :-1].float()  # predicts tokens 1..n-1
            logprobs[row, 1:n] = torch.log_softmax(logits, -1).gather(-1, ids[1:n, None])[:, 0]
            top1[row, 1:n] = (logits.argmax(-1) == ids[1:n]).float()
    return logprobs, top1


def half_greedy(hf_dir: str, batch) -> torch.Tensor:
    """The batch's tokens with each response token replaced, with probability 1/2, by the model's
    greedy choice there (in order, so later choices see the earlier ones)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens, coin = batch.tokens.clone(), torch.Generator().manual_seed(3)
    with torch.no_grad():
        step = model(tokens[:, :1], use_cache=True)  # one token a step, the earlier ones' K and V kept
        for column in range(1, MAX_LEN):
            greedy = step.logits[:, -1].argmax(-1)
            take = batch.loss_mask[:, column].bool() & (torch.rand(len(tokens), generator=coin) < 0.5)
            tokens[:, column] = torch.where(take, greedy, tokens[:, column])
            step = model(tokens[:, column:column + 1], past_key_values=step.past_key_values, use_cache=True)
    return tokens


@pytest.fixture(scope="module")
def scored(hf_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher_layout")
    batch = synthetic_batch(250, max_len=MAX_LEN)
    with one_thread():
        torch.save(half_greedy(hf_models["qwen3"], batch), folder / "tokens.pt")
    run("tests/workers/teacher_layout.py", "--student", hf_models["qwen3"], "--other", hf_models["llama"],
        "--moe", hf_models["qwen3_moe"], "--tokens", str(folder / "tokens.pt"),
        "--out", str(folder / "out.pt"), nproc=2, timeout=900)
    out = torch.load(folder / "out.pt")
    with one_thread():
        out["reference"] = {name: transformers_reference(hf_models[model], out["tokens"], out["lengths"])
                            for name, model in TEACHERS.items()}
    return out


@pytest.mark.parametrize("teacher", sorted(TEACHERS))
def test_teacher_logprobs_at_its_own_layout_equal_transformers(scored, teacher):
    assert scored["actor_axes"] == (1, 2, 1) and scored["tp2_axes"] == (2, 1, 1)  # (tp, pp, dp)
    assert scored["moe_ep2_axes"] == (2, 2)  # (ep, dp)
    mask = scored["loss_mask"].bool()
    expected, _ = scored["reference"][teacher]
    got, _ = scored[teacher]
    error = (got - expected)[mask].abs().max().item()
    assert error < 1e-4, f"{teacher}: the teacher's log-probs differ from transformers' by up to {error}"


@pytest.mark.parametrize("teacher", sorted(TEACHERS))
def test_top1_match_is_transformers_argmax(scored, teacher):
    mask = scored["loss_mask"].bool()
    _, expected = scored["reference"][teacher]
    _, got = scored[teacher]
    assert torch.equal(got[mask], expected[mask])
    if teacher == "tp2":  # half the responses are its own greedy tokens
        assert 0.3 < expected[mask].mean() < 0.8


def test_teacher_equal_to_student_gives_exactly_zero_distill_term(scored):
    """The student's checkpoint as teacher at the actor's layout: the same numbers as the actor's
    old log-probs, so the reverse-KL term and its metric are exactly 0."""
    mask = scored["loss_mask"]
    old, same = scored["old"], scored["same"]
    assert torch.equal(old * mask, same * mask)
    term = distill_advantages(torch.zeros_like(old), old, same, mask, coeff=1.0)
    assert torch.count_nonzero(term) == 0
    assert distill_metrics(old, same, torch.zeros_like(old), mask)["distill/reverse_kl"] == 0


def test_offload_frees_the_teachers_parameters_between_uses(scored):
    """Parked: no bytes of the teacher's parameters on the device, all of them in its host copy;
    after each use parked again; scoring again after the round trip gives the same numbers. The
    teacher built with offload off keeps its bytes."""
    assert scored["tp2_param_bytes"] > 1e6
    assert scored["tp2_parked_device_bytes"] == scored["tp2_after_use_device_bytes"] == 0
    assert scored["tp2_host_bytes"] == scored["tp2_param_bytes"]
    assert all(torch.equal(a, b) for a, b in zip(scored["tp2"], scored["tp2_again"]))
    assert scored["other_device_bytes"] > 1e6


def test_the_actors_groups_are_current_again_after_the_teachers(scored):
    assert torch.equal(scored["old"], scored["old_after"])


def test_a_teacher_layout_that_does_not_divide_the_world_is_refused_by_name():
    with pytest.raises(ValueError, match=r"teacher.tp=3, teacher.pp=1, teacher.ep=1 in the trainer's world "
                                         r"of 32 ranks: tp\(3\) \* pp\(1\)"):
        teacher_dims(TeacherConfig(hf_dir="unused", tp=3), 32)


def test_flops_count_the_teachers_forward_with_its_own_architecture():
    """A step's teacher_logprobs phase costs what old_logprobs would cost a run of the teacher's
    model: Qwen3-32B (dense, 32.8B) teaching Qwen3-30B-A3B (3.3B active) costs ~10x the student's
    forward over the same tokens."""
    student, teacher = arch_from_hf_config(QWEN3_30B_A3B), arch_from_hf_config(QWEN3_32B)
    lengths = [300, 1200, 4096]
    run = dict(reference=False, critic=False, actor_epochs=1, critic_epochs=1)
    got = flops.step_flops(student, flops.rl_phases(lengths, lengths, **run, teacher=teacher))
    as_its_own_run = flops.step_flops(teacher, flops.rl_phases(lengths, lengths, **run))
    assert got["teacher_logprobs"] == as_its_own_run["old_logprobs"]
    assert 5 < got["teacher_logprobs"] / got["old_logprobs"] < 15


def _teacher_folder(tmp_path, hf_config: dict) -> str:
    folder = tmp_path / "teacher"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config))
    return str(folder)


def test_plan_memory_shows_the_teacher_phase_and_preflight_refuses_one_that_does_not_fit(tmp_path):
    """Qwen3-32B (published config) as the teacher of the Qwen3-30B-A3B preset (32 GPUs of 80 GB):
    at teacher.tp=4, teacher.pp=2 the plan's teacher_logprobs phase holds the actor's training
    state plus 1/8 of the teacher's published 32.8B bf16 parameters (within the embedding's
    imbalance across stages) and its forward, and the run fits; at teacher.tp=1 its 65.6 GB per
    GPU do not, and preflight refuses the run naming the teacher and its layout."""
    teacher = _teacher_folder(tmp_path, QWEN3_32B)
    distill = [f"teacher.hf_dir={teacher}", "algo.distill.coeff=1.0"]
    config, _ = load_preset(QWEN, tmp_path, *distill, "teacher.tp=4", "teacher.pp=2")
    request = memory_plan.request_for_run(resolve(config), 80 * memory_plan.GB, gpu=True,
                                          runtime_bytes=memory_plan.RUNTIME_RESERVE_GB * memory_plan.GB)
    stages = memory_plan.plan_memory(request)
    per_gpu = 32.8e9 * 2 / 8
    for stage in stages:
        assert abs(stage.terms["teacher_params"] / per_gpu - 1) < 0.05, stage.terms["teacher_params"]
        forward = sum(stage.terms[k] for k in ("teacher_forward_layer", "teacher_logits",
                                                "teacher_logprob_forward"))
        actor_forward = sum(stage.terms[k] for k in ("actor_forward_layer", "actor_logits",
                                                     "actor_logprob_forward"))
        assert stage.phases["teacher_logprobs"] == pytest.approx(
            stage.phases["old_logprobs"] - actor_forward + stage.terms["teacher_params"] + forward)
        # offloaded: outside its phase the teacher holds nothing on the GPU
        assert stage.phases["actor_update"] < stage.phases["teacher_logprobs"]
    assert memory_plan.summary(request, stages)["fits"]

    (tmp_path / "tp1").mkdir()
    config, _ = load_preset(QWEN, tmp_path / "tp1", *distill)
    with pytest.raises(ValueError, match=r"its teacher_logprobs phase \(with the distillation teacher "
                                         rf"'{teacher}': 6\d\.\d+ GB of its weights per GPU at teacher.tp=1, "
                                         r"teacher.pp=1\) needs .* raise teacher.tp or teacher.pp"):
        check_preset(config)
