"""HF -> Megatron -> HF with the user-facing scripts: bit-exact for every family and variant,
on one rank and on two; the exported checkpoint loads in transformers; bad input is refused."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import MODELS
from tests.launch import ROOT, finish, last_json, load_script, run, start

ODD = "deepseek_v3_3layers"  # conftest.ODD_LAYER_MODELS: PP2 splits its 3 layers 1 + 2

# Exported by scripts/convert.py megatron-to-hf itself, one per world size; the others by its
# function, one launch per world size (tests/workers/convert_models.py: a launch costs more here
# than a tiny conversion). The export's world is the opposite of the import side's, mostly.
BY_THE_SCRIPT = {"qwen3_moe": 1, "glm4_moe": 2}


@pytest.fixture(scope="module")
def exported(megatron_models, tmp_path_factory):
    """{model: the HF export of its Megatron conversion}, made once (the round trip and the
    transformers check read the same export). The four launches run at once: none needs another's
    output, and two of them have one rank."""
    root = tmp_path_factory.mktemp("exported")
    out = {model: str(root / model) for model in MODELS}
    batched, launches = {1: [], 2: []}, []
    for model in MODELS:
        nproc = 1 if model in ("qwen3_moe", "llama") else 2
        if model in BY_THE_SCRIPT:
            launches.append(start("scripts/convert.py", "megatron-to-hf", "--megatron-dir",
                                  megatron_models[model], "--out", out[model], nproc=BY_THE_SCRIPT[model]))
        else:
            batched[nproc].append(["megatron_to_hf", megatron_models[model], out[model]])
    for nproc, jobs in batched.items():
        launches.append(start("tests/workers/convert_models.py", "--jobs", json.dumps(jobs), nproc=nproc,
                              timeout=900))
    finish(*launches)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_round_trip_is_bit_exact(model, hf_models, exported):
    out = exported[model]
    # scripts/compare_hf_checkpoints.py's comparison, in this process (launching it took 4 of a
    # case's 10 s; tests/test_loop.py and tests/test_slurm.py run the script itself)
    result = load_script("compare_hf_checkpoints").compare(hf_models[model], out)
    assert result["bit_exact"], result
    with open(os.path.join(hf_models[model], "config.json")) as a, \
            open(os.path.join(out, "config.json")) as b:
        assert json.load(a) == json.load(b)


# Both exported with 2 ranks; DeepSeek-V3's declares an MTP layer without its weights, as
# transformers saves it (megarl/demo/tiny_checkpoint.py). vLLM loads such an export in
# tests/test_weight_sync.py's DeepSeek cases (a fresh engine from the run's HF export).
# gpt-oss: its fused experts; Qwen3-Next: its fused linear-attention projections.
@pytest.mark.parametrize("model", ["mixtral", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_exported_checkpoint_loads_in_transformers(model, hf_models, exported):
    import transformers

    tokens = torch.arange(20).reshape(2, 10)
    logits = [transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(tokens).logits
              for d in (hf_models[model], exported[model])]
    assert torch.equal(logits[0], logits[1])


def test_converter_names_its_directions():
    """scripts/convert.py's first argument is the direction: its --help says what each does, and a
    missing or unknown one is refused naming both (before torch loads: a quick failure under
    torchrun or sbatch)."""
    def convert(*args):  # a fresh interpreter, as a user's (the test's zygote has torch loaded)
        return subprocess.run([sys.executable, "scripts/convert.py", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)

    helped = convert("--help")
    assert "hf-to-megatron  an HF checkpoint" in helped.stdout
    assert "megatron-to-hf  a megarl Megatron checkpoint" in helped.stdout
    for args in ([], ["hf_to_megatron", "--hf-dir", "x", "--out", "y"]):
        proc = convert(*args)
        assert proc.returncode == 2, proc.stderr
        assert "hf-to-megatron" in proc.stderr and "megatron-to-hf" in proc.stderr, proc.stderr
    proc = convert("megatron-to-hf", "--hf-dir", "x", "--out", "y")
    assert proc.returncode == 2 and "required: --megatron-dir" in proc.stderr, proc.stderr


def test_converter_refuses_existing_output(hf_models, megatron_models):
    proc = run("scripts/convert.py", "hf-to-megatron", "--hf-dir", hf_models["llama"],
               "--out", megatron_models["llama"], check=False)
    assert proc.returncode != 0
    assert "already exists" in proc.stderr


def test_converter_refuses_unknown_tensors(hf_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(hf_models["qwen3"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    proc = run("scripts/convert.py", "hf-to-megatron", "--hf-dir", str(bad),
               "--out", str(tmp_path / "out"), check=False)
    assert proc.returncode != 0
    assert "model.layers.0.mlp.extra_proj.weight" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def odd_converted(hf_models, tmp_path_factory):
    """(Megatron dir, the script's JSON): the 3-layer tiny DeepSeek-V3 converted by scripts/convert.py
    on two ranks, which no even split fits."""
    out = str(tmp_path_factory.mktemp("odd") / "megatron")
    return out, last_json(run("scripts/convert.py", "hf-to-megatron", "--hf-dir", hf_models[ODD],
                              "--out", out, nproc=2))


def test_each_rank_reads_only_its_share(hf_models, odd_converted):
    """Each rank reads the HF tensors of its own stage's layers, the first stage (embedding and
    layer 0) being the smaller, and no other."""
    from megarl.models.hf.safetensors_reader import SafetensorsReader

    _, result = odd_converted
    assert (result["layout"]["pp"], result["layout"]["first_stage_layers"]) == (2, 1)
    reader = SafetensorsReader(hf_models[ODD])
    names = reader.names()
    reader.close()
    first = [n for n in names if n.startswith(("model.embed_tokens.", "model.layers.0."))]
    assert result["hf_tensors_read_per_rank"] == [len(first), len(names) - len(first)]
    assert result["hf_tensors_in_checkpoint"] == len(names)


def test_verify_conversion_checks_at_the_converter_s_uneven_stages(hf_models, odd_converted):
    """--pp 2 on 3 layers: verify_conversion splits them as the converter did (no flag needed;
    issue 49), and the model's log-probs, loss and every gradient match HF transformers'."""
    megatron, converted = odd_converted
    result = last_json(run("scripts/verify_conversion.py", "--hf-dir", hf_models[ODD], "--megatron-dir",
                           megatron, "--pp", "2", "--grads", nproc=2))
    assert result["layout"] == converted["layout"], result
    assert result["max_abs_logprob_diff"] <= 1e-4, result
    assert result["loss_rel_diff"] <= 1e-5, result
    assert result["max_grad_rel_diff"] <= 5e-5, result  # as tests/test_layout_parity.py holds them


def test_qwen3_next_mtp_layer_is_kept_byte_for_byte(hf_models, tmp_path):
    """A Qwen3-Next checkpoint as published: an MTP layer under mtp.* (fc, its norms, one decoder
    layer) beside the model, declared by mtp_num_hidden_layers. Not trained, kept aside through
    HF -> Megatron (two ranks) -> HF (one), and given back unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(hf_models["qwen3_next"], hf)
    main = load_file(str(hf / "model.safetensors"))
    last = "model.layers.3."
    gen = torch.Generator().manual_seed(0)
    mtp = {"mtp.layers.0." + n[len(last):]: torch.randn(t.shape, generator=gen) for n, t in main.items()
           if n.startswith(last)}
    mtp.update({f"mtp.{n}": torch.randn(256, generator=gen) for n in
                ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")})
    mtp["mtp.fc.weight"] = torch.randn(256, 512, generator=gen)
    save_file({**main, **mtp}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    megatron, back = str(tmp_path / "megatron"), str(tmp_path / "back")
    imported = last_json(run("scripts/convert.py", "hf-to-megatron", "--hf-dir", str(hf), "--out", megatron,
                             nproc=2))
    assert imported["notes"] == [] and imported["hf_tensors_in_checkpoint"] == len(main) + len(mtp)
    run("scripts/convert.py", "megatron-to-hf", "--megatron-dir", megatron, "--out", back)
    result = load_script("compare_hf_checkpoints").compare(str(hf), back)
    assert result["bit_exact"] and result["tensors"] == len(main) + len(mtp), result


def test_gpt_oss_mxfp4_experts_round_trip_bit_exact(tmp_path):
    """gpt-oss as published (experts as MXFP4 blocks and scales): dequantized on load and written
    back as MXFP4 by megatron-to-hf --experts mxfp4, bit for bit, config.json equal; the refusal
    of --experts mxfp4 for a family without MXFP4 experts is tests/test_gpt_oss.py's."""
    from megarl.demo.tiny_checkpoint import make_named

    hf = make_named("gpt_oss_mxfp4", str(tmp_path / "hf"))
    megatron, back = str(tmp_path / "megatron"), str(tmp_path / "back")
    run("scripts/convert.py", "hf-to-megatron", "--hf-dir", hf, "--out", megatron)
    run("scripts/convert.py", "megatron-to-hf", "--megatron-dir", megatron, "--out", back,
        "--experts", "mxfp4")
    result = load_script("compare_hf_checkpoints").compare(hf, back)
    assert result["bit_exact"] and result["tensors"] == 79, result  # 4 layers x 2 x (blocks, scales)
    with open(os.path.join(hf, "config.json")) as a, open(os.path.join(back, "config.json")) as b:
        assert json.load(a) == json.load(b)
