"""Broken checkpoints are refused by name before any weight is loaded: a missing directory, a
missing or truncated shard, an unreadable index, in HF (safetensors) and Megatron (dist
checkpoint) format, through the converters users run."""

import json
import os
import shutil

import pytest

from megarl.models.hf.safetensors_reader import SafetensorsReader
from megarl.models.weights import checkpoint
from tests.launch import finish, start


def _truncate(path, keep: float = 0.5):
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


def test_missing_and_truncated_hf_shards(hf_models, tmp_path):
    copy = tmp_path / "hf"
    shutil.copytree(hf_models["qwen3"], copy)
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors or model.safetensors.index.json"):
        SafetensorsReader(str(tmp_path / "nowhere"))
    _truncate(copy / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file .*truncated"):
        SafetensorsReader(str(copy))
    # A sharded checkpoint whose index names a shard that is not there.
    os.remove(copy / "model.safetensors")
    (copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    reader = SafetensorsReader(str(copy))
    with pytest.raises(FileNotFoundError, match=r"shard model-00001-of-00002.safetensors \(listed in "
                                                r"model.safetensors.index.json\) is missing"):
        reader("model.embed_tokens.weight")


def test_missing_and_truncated_megatron_shards(megatron_models, tmp_path):
    copy = tmp_path / "megatron"
    shutil.copytree(megatron_models["llama"], copy)
    checkpoint.check_files(str(copy))  # the intact copy passes
    shards = sorted(name for name in os.listdir(copy) if name.endswith(".distcp"))
    _truncate(copy / shards[0], keep=0.9)
    with pytest.raises(ValueError, match=rf"is incomplete: shard {shards[0]} has \d+ bytes of the \d+ its "
                                         r"index names; copy the checkpoint again"):
        checkpoint.check_files(str(copy))
    os.remove(copy / shards[0])
    with pytest.raises(ValueError, match=rf"shard {shards[0]} is missing"):
        checkpoint.check_files(str(copy))
    os.remove(copy / ".metadata")
    with pytest.raises(ValueError, match=r"its index .metadata is missing or unreadable"):
        checkpoint.check_files(str(copy))


def test_converters_refuse_broken_inputs(hf_models, megatron_models, tmp_path):
    megatron = tmp_path / "megatron"
    shutil.copytree(megatron_models["qwen3"], megatron)
    shard = sorted(name for name in os.listdir(megatron) if name.endswith(".distcp"))[-1]
    _truncate(megatron / shard)
    hf = tmp_path / "hf"
    shutil.copytree(hf_models["qwen3"], hf)
    _truncate(hf / "model.safetensors")
    outs = [tmp_path / name for name in ("out", "out_nowhere", "m")]
    # The three launches at once: each has one rank, and none reads what another writes.
    procs = finish(
        start("scripts/convert.py", "megatron-to-hf", "--megatron-dir", str(megatron), "--out",
              str(outs[0]), check=False),
        start("scripts/convert.py", "megatron-to-hf", "--megatron-dir", str(tmp_path / "nowhere"), "--out",
              str(outs[1]), check=False),
        start("scripts/convert.py", "hf-to-megatron", "--hf-dir", str(hf), "--out", str(outs[2]),
              check=False))
    said = [f"shard {shard} has", "megarl_model.json is missing", "not a readable safetensors file"]
    for proc, message in zip(procs, said):
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]
    assert not any(out.exists() for out in outs)
