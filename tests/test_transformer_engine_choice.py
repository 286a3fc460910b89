"""Transformer Engine on purpose (model.transformer_engine, MEGARL_TRANSFORMER_ENGINE): the choice
for every setting and machine, the refusals, what a GPU run without TE turns off and says (once
per node), the ranks' agreement on it (refused on real gloo ranks made to disagree), the no-TE
shims on their own, and the config key that carries the setting to every process."""

import importlib
import json
import socket

import pytest

from megarl.models.megatron.config import gpu_switches
from megarl.planning.config import ModelConfig
from megarl.planning.typed_config import load
from megarl.platform import no_te_compat
from megarl.platform.device_choice import (
    choose_transformer_engine,
    node_lines,
    set_transformer_engine,
    spec_choice,
    spec_refusal,
    te_off_line,
)
from tests.launch import finish, start

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


def job(*nodes):
    """SpecChoices of a job: nodes given as (host, ranks, setting, on_gpu, te_error)."""
    return [spec_choice(rank, host, setting, on_gpu, te_error)
            for host, ranks, setting, on_gpu, te_error in nodes for rank in ranks]


OFF_LINE = te_off_line(None, True, False, NO_TE)
FALSE_LINE = te_off_line("false", True, False, None)
A_TE, A_NO_TE = ("gpu-a", range(8), None, True, None), ("gpu-a", range(8), "auto", True, NO_TE)
B_NO_TE = ("gpu-b", range(8, 16), None, True, NO_TE)


def test_a_gpu_job_without_te_says_so_once_per_node():
    """Eight ranks on each of two nodes: two lines, each naming its node and ranks."""
    assert node_lines(job(A_NO_TE, B_NO_TE)) == [f"{OFF_LINE} [gpu-a, ranks 0-7]",
                                                 f"{OFF_LINE} [gpu-b, ranks 8-15]"]
    # ranks of a node placed apart (Ray numbers them node by node; a hand-made launch may not)
    apart = job(("gpu-a", [0, 1, 4], "false", True, None), ("gpu-b", [2, 3], "false", True, None))
    assert node_lines(apart) == [f"{FALSE_LINE} [gpu-a, ranks 0-1, 4]", f"{FALSE_LINE} [gpu-b, ranks 2-3]"]
    assert node_lines(job(("gpu-a", [0], "auto", True, NO_TE))) == [f"{OFF_LINE} [gpu-a, rank 0]"]
    assert node_lines(job(A_TE)) == []  # with TE: nothing to say
    assert node_lines(job(("cpu-a", range(4), None, False, None))) == []  # the CPU path never has TE


def test_ranks_that_agree_are_not_refused():
    assert spec_refusal(job(A_TE, ("gpu-b", range(8, 16), "true", True, None))) is None
    assert spec_refusal(job(("gpu-a", range(8), "false", True, None), B_NO_TE)) is None


def test_a_node_without_te_beside_one_with_it_is_refused_naming_both():
    assert spec_refusal(job(A_TE, B_NO_TE)) == (
        "megarl: the ranks chose different layer specs, so they would build different models (ranks "
        "0-7 on gpu-a: Transformer Engine's layer spec; ranks 8-15 on gpu-b: the portable layer spec "
        f"(model.transformer_engine=auto and transformer_engine does not import: {NO_TE})). Every "
        "rank must build the same one: install Transformer Engine on every node (the same "
        "environment everywhere: `make install DEVICE=cuda` (its own environment, .venv-cuda)), or "
        "set model.transformer_engine=false to run Megatron's portable layer spec on all of them")


def test_a_rank_that_cannot_choose_refuses_the_whole_job():
    # one node, TE missing: auto takes the portable spec, `true` (set on some ranks only) cannot
    refusal = spec_refusal(job(("gpu-a", range(4), None, True, NO_TE),
                               ("gpu-a", range(4, 8), "true", True, NO_TE)))
    assert refusal.startswith(
        "megarl: not every rank could choose a layer spec (ranks 0-3 on gpu-a: the portable layer "
        f"spec (model.transformer_engine=auto and transformer_engine does not import: {NO_TE}); "
        "ranks 4-7 on gpu-a: no layer spec (MEGARL_TRANSFORMER_ENGINE=true (model.transformer_engine) "
        "but Transformer Engine is missing"), refusal


@pytest.fixture(scope="module")
def disagreeing_ranks(hf_models, tmp_path_factory):
    """The converter on two gloo ranks, twice, at once: rank 1 with MEGARL_TRANSFORMER_ENGINE=true
    (on this CPU machine: a rank that cannot choose), and rank 1 choosing as a GPU node where
    Transformer Engine imports (tests/workers/layer_spec_ranks.py)."""
    runs = {"env": ["--rank-env", json.dumps({"1": {"MEGARL_TRANSFORMER_ENGINE": "true"}})],
            "te_node": ["--te-ranks", "[1]"]}
    folders = {name: tmp_path_factory.mktemp(f"layer_spec_{name}") for name in runs}
    finish(*[start("tests/workers/layer_spec_ranks.py", "--hf-dir", hf_models["qwen3"], "--out-dir",
                   str(folders[name]), *flags, nproc=2, timeout=300) for name, flags in runs.items()])
    return {name: [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
            for name, folder in folders.items()}


def test_ranks_on_different_layer_specs_are_refused_before_any_model_is_built(disagreeing_ranks):
    host = socket.gethostname()
    expected = {
        "env": (f"megarl: not every rank could choose a layer spec (rank 0 on {host}: the portable "
                f"layer spec (the CPU path); rank 1 on {host}: no layer spec (MEGARL_TRANSFORMER_ENGINE="
                "true (model.transformer_engine) but this process takes the CPU path"),
        "te_node": (f"megarl: the ranks chose different layer specs, so they would build different models "
                    f"(rank 0 on {host}: the portable layer spec (the CPU path); rank 1 on te-node: "
                    "Transformer Engine's layer spec). Every rank must build the same one"),
    }
    for name, ranks in disagreeing_ranks.items():
        for rank, result in enumerate(ranks):
            assert result["refusal"].startswith(expected[name]), (name, rank, result["refusal"])
            assert "set model.transformer_engine=false" in result["refusal"]
            # refused where the world starts: the converter made no output, not even its partial one
            assert not result["written"] and not result["partial"], (name, rank)


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
