"""scripts/gpu_check.sh, the GPU check of a bare GPU machine, run end to end with --device cpu (the
same steps at CPU sizes), what it plans for a GPU, how it judges results, and the size of what
travels to the GPU machine (scripts/gpu_travel_size.py)."""

import json
import os
import subprocess
import sys

from tests.launch import ROOT, load_script


def _gpu_check():
    return load_script("gpu_check")


def test_check_on_cpu_runs_every_step_and_every_check_holds(tmp_path):
    out = tmp_path / "out"
    # two steps at a time: each is one process, and this machine has two cores
    # no --python: the script takes the project's environment (.venv), as on a machine whose python3
    # has no torch
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--out", str(out),
                           "--jobs", "2"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k != "OUT"})
    assert sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log"], proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert proc.returncode == 0 and report["passed"], (report.get("problems"), proc.stdout[-2000:])
    steps = report["steps"]
    assert report["environment"]["MEGARL_DEVICE"] == "cpu" and report["environment"]["megatron-core"]
    assert all(step["rc"] == 0 for step in steps.values()), steps

    rows = {(r["dtype"], r["model"]): r for r in steps["parity"]["results"]}
    assert set(rows) == {(d, f) for d in ("float32", "bfloat16") for f in _gpu_check().FAMILIES}
    for (dtype, _), row in rows.items():
        assert row["num_grads"] > 10, row  # gradients of every parameter were compared
        if dtype == "float32":
            assert row["max_abs_logprob_diff"] <= 1e-4 and row["max_grad_rel_diff"] <= 1e-4, row
        else:  # the hybrids' bound: bench/parity_sweep.py HYBRID_BF16 (HF's own bf16 error)
            assert row["within_tolerance"] and row["tolerance"]["mean_abs_logprob_diff"] <= 0.16, row
            assert row["mean_abs_logprob_diff"] <= row["tolerance"]["mean_abs_logprob_diff"], row
            assert row["max_abs_logprob_diff"] > 1e-4, row  # the model really ran in bf16

    for model in ("qwen3-30b-a3b", "deepseek-v3"):
        (memory,) = steps[f"memory_{model}"]["results"]
        assert memory["measured_by"].startswith("VmHWM") and memory["widths"] == "tiny", memory
        for phase in ("old_logprobs", "actor_update"):
            numbers = memory["phases"][phase]
            assert numbers["measured_gb"] > 0.1 and numbers["planned_gb"] > 0.1, memory
            assert abs(numbers["error"]) <= memory["bound"] == 0.15, memory  # the CPU's bound (GPU: 0.10)

    for kind, family in (("dense", "qwen3"), ("moe", "qwen3_moe")):
        cases = {r["case"]: r for r in steps[f"bench_train_{kind}"]["results"]}
        update, packing = cases["actor_update_vs_bare"], cases["packed_vs_padded"]
        assert update["family"] == family and update["dtype"] == "bfloat16", update
        assert update["megarl_seconds"] > 0 and update["bare_seconds"] > 0, update
        assert packing["packed_tokens_per_s"] > 0 and packing["padded_tokens_per_s"] > 0, packing

    heads = {r["kernels"]: r for r in steps["logprob_head"]["results"] if r["case"] == "head"}
    assert set(heads) == {"eager", "compiled"} and all(r["meets_target"] for r in heads.values()), heads
    megatron = [r for r in steps["logprob_head"]["results"] if r["case"] == "megatron"]
    assert len(megatron) == 1 and megatron[0]["seconds"] > 0, steps["logprob_head"]["results"]

    (copies,) = steps["sync_copies"]["results"]
    assert copies["device"] == "cpu" and copies["copies"] == 16, copies
    assert copies["batched_us_per_copy"] > 0 and copies["plain_copy_GBps"] > 0, copies


def test_the_gpu_plan_is_the_issue_s_check():
    check = _gpu_check()
    steps = {s.name: s for s in check.plan_steps("cuda", check.FAMILIES, "/w")}
    parity = steps["parity"].argv
    assert parity[parity.index("--dtypes") + 1] == "float32,bfloat16"
    assert parity[parity.index("--families") + 1].split(",") == check.FAMILIES and len(check.FAMILIES) == 12
    for kind in ("dense", "moe"):
        argv = steps[f"bench_train_{kind}"].argv
        assert int(argv[argv.index("--hidden") + 1]) >= 2048 and "bfloat16" in argv, argv
    # the dense case is issue 48's H200 shapes: Qwen3's vocabulary, 16K-token micro-batches
    dense = steps["bench_train_dense"].argv
    flags = ("--hidden", "--vocab", "--seq-len", "--micro-batch-tokens")
    assert [dense[dense.index(flag) + 1] for flag in flags] == ["4096", "151936", "4096", "16384"], dense
    head = steps["logprob_head"].argv
    assert head[head.index("--vocab") + 1] == "151936" and "--megatron" in head, head
    for model in ("qwen3-30b-a3b", "deepseek-v3"):
        assert steps[f"memory_{model}"].argv[-2:] == ["--widths", "real"]
    assert steps["sync_copies"].argv[1:3] == ["--device", "cuda"]
    # the default budget holds every step inside the device tool's 10 minutes, install included
    assert all(s.timeout_s <= 540 for s in steps.values())


def test_problems_name_each_failed_check():
    check = _gpu_check()
    ok_row = {"dtype": "float32", "model": "qwen3", "within_tolerance": True}
    bad_row = {"dtype": "bfloat16", "model": "qwen3", "within_tolerance": False,
               "tolerance": {"grad_rel_norm_diff": 0.16}}
    steps = {
        "parity": {"rc": 0, "results": [ok_row, bad_row]},
        "memory_deepseek-v3": {"rc": 0, "results": [{"within_bound": False, "worst_error": 0.3,
                                                     "bound": 0.15}]},
        "bench_train_moe": {"rc": "timeout", "results": [{"case": "actor_update_vs_bare"}]},
        "sync_copies": {"rc": 0, "results": [{}]},
    }
    assert check.problems(steps, ["qwen3", "llama"]) == [
        "bench_train_moe: exit timeout",
        "parity float32 llama: no result",
        'parity bfloat16 qwen3: outside {"grad_rel_norm_diff": 0.16}',
        "parity bfloat16 llama: no result",
        "memory_deepseek-v3: worst error 0.3 > 0.15",
        "bench_train_moe: cases ['actor_update_vs_bare']",
    ]
    both = [ok_row, {**ok_row, "dtype": "bfloat16"}]
    assert check.problems({"parity": {"rc": 0, "results": both}}, ["qwen3"]) == []


def test_the_dense_update_and_the_head_are_held_to_their_targets_on_a_gpu():
    check = _gpu_check()

    def dense(overhead, packing):
        return {"bench_train_dense": {"rc": 0, "results": [
            {"case": "actor_update_vs_bare", "overhead_ratio": overhead},
            {"case": "packed_vs_padded", "speedup": packing}]}}

    assert check.problems(dense(0.1, 1.5), []) == []
    assert check.problems(dense(0.25, 1.13), []) == ["bench_train_dense: update overhead 0.250 > 0.1",
                                                      "bench_train_dense: packing 1.13x < 1.5x"]
    assert check.problems(dense(0.25, 1.13), [], device="cpu") == []  # CPU sizes time nothing
    head = {"logprob_head": {"rc": 0, "results": [
        {"case": "head", "kernels": "compiled", "peak_over_fp32_logits": 0.5, "meets_target": True},
        {"case": "head", "kernels": "eager", "peak_over_fp32_logits": 1.5, "meets_target": False},
        {"case": "megatron", "seconds": 0.04}]}}
    assert check.problems(head, []) == ["logprob_head: eager peak 1.50x the fp32 logits > 1.0x"]
    assert check.problems({"logprob_head": {"rc": 0, "results": []}}, []) == ["logprob_head: no result"]


def test_travel_size_sums_the_wheels_and_refuses_over_the_limit(tmp_path):
    size = load_script("gpu_travel_size")
    (tmp_path / "a.whl").write_bytes(b"x" * 3_000_000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.whl").write_bytes(b"x" * 1_000_000)
    assert size.folder_bytes(str(tmp_path)) == 4_000_000
    assert size.verdict(55_000_000, 4_000_000, 60.0) == {
        "checkout_mb": 55.0, "wheels_mb": 4.0, "total_mb": 59.0, "limit_mb": 60.0, "fits": True}
    assert not size.verdict(57_000_000, 4_000_000, 60.0)["fits"]


def test_travel_size_script_and_a_missing_wheel_folder(tmp_path):
    (tmp_path / "m.whl").write_bytes(b"x" * 2_000_000)
    script = [sys.executable, "scripts/gpu_travel_size.py", str(tmp_path)]
    fits = subprocess.run(script, cwd=ROOT, capture_output=True, text=True)
    result = json.loads(fits.stdout)
    assert fits.returncode == 0 and result["wheels_mb"] == 2.0 and 0 < result["checkout_mb"] < 58, result
    over = subprocess.run([*script, "--limit-mb", "2"], cwd=ROOT, capture_output=True, text=True)
    assert over.returncode == 1 and "over 2.0 MB" in over.stderr, over.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--wheels", str(empty), "--out",
                           str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "make gpu-wheels" in proc.stderr, proc.stderr
    assert str(empty) in proc.stderr, proc.stderr
    no_torch = tmp_path / "python"
    no_torch.write_text("#!/bin/sh\nexit 1\n")  # a Python that cannot import torch
    no_torch.chmod(0o755)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--python", str(no_torch),
                           "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and f"{no_torch} cannot import torch: run 'make install'" in proc.stderr, \
        proc.stderr
