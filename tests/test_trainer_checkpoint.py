"""Which trainer checkpoints count as complete, and the refusals made before any work: a
checkpoint of another model, a --resume path that is not a complete checkpoint. (Saving and
exact resume run end to end in tests/test_loop.py.)"""

import json

import pytest

from megarl.models.weights import checkpoint
from megarl.trainer import checkpoint as trainer_checkpoint


def _complete(run_dir, step):
    path = trainer_checkpoint.step_dir(str(run_dir), step)
    (run_dir / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    with open(f"{path}/{trainer_checkpoint.TRAINER_FILE}", "w") as f:
        json.dump({"step": step}, f)
    return path


def test_only_complete_checkpoints_are_found_newest_last(tmp_path):
    assert trainer_checkpoint.resolve(str(tmp_path), "auto") is None  # nothing yet: start fresh
    _complete(tmp_path, 3)
    ten = _complete(tmp_path, 10)
    (tmp_path / "checkpoints" / "step_000020.partial").mkdir()  # a save that was killed
    (tmp_path / "checkpoints" / "step_000030").mkdir()  # renamed without trainer.json: not ours
    assert trainer_checkpoint.complete_checkpoints(str(tmp_path))[-1] == ten
    assert len(trainer_checkpoint.complete_checkpoints(str(tmp_path))) == 2
    assert trainer_checkpoint.resolve(str(tmp_path), "auto") == ten
    assert trainer_checkpoint.resolve(str(tmp_path), None) is None


def test_resume_path_that_is_not_a_checkpoint_is_refused(tmp_path):
    partial = tmp_path / "checkpoints" / "step_000020.partial"
    partial.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"step_000020.partial.*not a complete megarl checkpoint"):
        trainer_checkpoint.resolve(str(tmp_path), str(partial))


def test_checkpoint_of_another_model_is_refused_naming_the_field(tmp_path):
    config = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "hidden_size": 256}
    (tmp_path / checkpoint.MODEL_FILE).write_text(json.dumps({"role": "policy", "hf_config": config}))
    checkpoint.require_model(str(tmp_path), dict(config), "hf")  # the same model passes
    # ... stored otherwise too: converted from a block-FP8 copy, run with the bf16 one
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    checkpoint.require_model(str(tmp_path), {**config, "quantization_config": fp8}, "hf")
    with pytest.raises(ValueError, match=r"fields \['num_hidden_layers'\] differ \(e.g. num_hidden_layers: "
                                         r"4 vs 8\)"):
        checkpoint.require_model(str(tmp_path), {**config, "num_hidden_layers": 8}, "hf")
    with pytest.raises(FileNotFoundError, match="megarl_model.json is missing"):
        checkpoint.require_model(str(tmp_path / "nowhere"), config, "hf")
