"""Transformer Engine on purpose (model.transformer_engine, MEGARL_TRANSFORMER_ENGINE): the choice
for every setting and machine, the refusals, what a GPU run without TE turns off and says, the
no-TE shims on their own, and the config key that carries the setting to every process."""

import importlib

import pytest

from megarl.models.megatron_config import gpu_switches
from megarl.parallel_state import no_te_compat
from megarl.parallel_state.device_choice import (
    choose_transformer_engine,
    set_transformer_engine,
    te_off_line,
)
from megarl.trainer.config import ModelConfig
from megarl.trainer.typed_config import load

NO_TE = "ModuleNotFoundError: No module named 'transformer_engine'"


@pytest.mark.parametrize("setting,on_gpu,te_error,use_te", [
    (None, True, None, True), ("", True, None, True), ("auto", True, None, True),
    (" AUTO ", True, None, True), ("true", True, None, True),
    ("false", True, None, False),  # TE installed, turned off
    (None, True, NO_TE, False), ("auto", True, NO_TE, False),  # said in the first lines
    ("false", True, NO_TE, False),
    (None, False, None, False), ("auto", False, None, False), ("false", False, None, False),
])
def test_the_choice(setting, on_gpu, te_error, use_te):
    assert choose_transformer_engine(setting, on_gpu, te_error) is use_te


@pytest.mark.parametrize("setting,on_gpu,te_error,error,message", [
    ("true", True, "ImportError: libcudnn.so.9", RuntimeError,
     r"MEGARL_TRANSFORMER_ENGINE=true \(model.transformer_engine\) but Transformer Engine is missing "
     r"\(transformer_engine: ImportError: libcudnn.so.9\): install the GPU build with `make install "
     r"DEVICE=cuda` .*or set model.transformer_engine=false to run Megatron's portable layer spec"),
    ("true", False, None, RuntimeError,
     r"MEGARL_TRANSFORMER_ENGINE=true \(model.transformer_engine\) but this process takes the CPU path "
     r"\(MEGARL_DEVICE=cpu, or no GPU here\).*set it to auto or false"),
    ("on", True, None, ValueError, r"MEGARL_TRANSFORMER_ENGINE='on': use one of auto, true, false"),
    ("maybe", False, None, ValueError, r"'maybe'"),  # a typo is refused even where it would not matter
])
def test_what_cannot_be_honoured_is_refused_with_the_fix(setting, on_gpu, te_error, error, message):
    with pytest.raises(error, match=message):
        choose_transformer_engine(setting, on_gpu, te_error)


def test_without_te_on_a_gpu_only_te_kernels_are_off():
    with_te = gpu_switches(True, True, interleaved=False, grad_accum_kernel=True)
    without = gpu_switches(True, False, interleaved=False, grad_accum_kernel=True)
    assert with_te["apply_rope_fusion"] and not without["apply_rope_fusion"]
    assert {k: v for k, v in without.items() if k != "apply_rope_fusion"} == \
        {k: v for k, v in with_te.items() if k != "apply_rope_fusion"}


def test_a_gpu_run_without_te_says_so_and_why():
    assert te_off_line("false", True, False, None) == (
        "megarl: Transformer Engine off (model.transformer_engine=false): Megatron's portable layer "
        "spec on CUDA, its attention unfused (memory quadratic in the sequence); TE-only fusions off")
    assert f"(model.transformer_engine=auto and transformer_engine does not import: {NO_TE})" in \
        te_off_line(None, True, False, NO_TE)
    assert te_off_line(None, True, True, None) is None  # with TE
    assert te_off_line("false", False, False, None) is None  # the CPU path: unchanged


def test_no_te_shims_install_on_their_own(monkeypatch):
    """What Megatron leaves without TE (or with TE turned off), set by no_te_compat alone, whatever
    cpu_compat did in this process."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    optimizer_config = importlib.import_module("megatron.core.optimizer.optimizer_config")
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(mla, "HAVE_TE", True)
    monkeypatch.setattr(mla, "Linear", None)
    monkeypatch.setattr(optimizer_config, "is_te_min_version", None)
    monkeypatch.setattr(no_te_compat, "_INSTALLED", False)
    assert no_te_compat.needed()  # this machine builds without TE
    no_te_compat.install()
    assert moe_utils.te_general_gemm is None  # the router's GEMM: torch.mm
    assert mla.HAVE_TE is False
    assert mla.Linear is importlib.import_module("megatron.core.post_training.modelopt.layers").Linear
    assert optimizer_config.is_te_min_version("2.1.0") is False


@pytest.mark.parametrize("word,value", [("auto", "auto"), ("false", False), ("true", True),
                                        ("off", False), ("on", True)])
def test_the_config_key_takes_auto_true_false(word, value):
    assert load(ModelConfig, None, ["hf_dir=x", f"transformer_engine={word}"]).transformer_engine == value
    assert load(ModelConfig, None, ["hf_dir=x"]).transformer_engine == "auto"


@pytest.mark.parametrize("word,message", [
    ("maybe", r"model.transformer_engine='maybe': use one of auto, true, false"),
    ("3", r"transformer_engine must be bool or str, got 3 \(int\)"),
])
def test_a_bad_config_value_is_refused_naming_the_key(word, message):
    with pytest.raises(ValueError, match=message):
        load(ModelConfig, None, ["hf_dir=x", f"transformer_engine={word}"])


def test_the_config_sets_the_variable_unless_it_says_otherwise():
    environ = {}
    set_transformer_engine("auto", environ)
    assert environ == {}  # auto leaves the variable (and the machine) to decide
    set_transformer_engine(False, environ)
    assert environ == {"MEGARL_TRANSFORMER_ENGINE": "false"}
    set_transformer_engine(False, environ)  # agreeing is fine
    environ = {"MEGARL_TRANSFORMER_ENGINE": "auto"}
    set_transformer_engine(True, environ)
    assert environ == {"MEGARL_TRANSFORMER_ENGINE": "true"}
    with pytest.raises(ValueError, match=r"model.transformer_engine=false but MEGARL_TRANSFORMER_ENGINE=true "
                                         r"in the environment: unset the variable, or make the two agree"):
        set_transformer_engine(False, {"MEGARL_TRANSFORMER_ENGINE": "true"})
