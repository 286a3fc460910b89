"""Hugging Face config.json -> ModelArch, the family-neutral description megarl builds from.

Owns: which architectures and config fields are supported, and the error that lists them.
Does not own Megatron types (see `models/megatron/config.py`) nor weight names (see
`models/weights/tables.py`).
"""

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from megarl.models.hf import config_deepseek as hf_config_deepseek
from megarl.models.hf import config_gpt_oss as hf_config_gpt_oss
from megarl.models.hf import config_qwen3_next as hf_config_qwen3_next
from megarl.models.hf import fp8_blocks
from megarl.models.hf.fields import require as _require
from megarl.models.hf.fields import rope_settings
from megarl.models.hf.fields import unsupported as _unsupported

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "GptOssForCausalLM": "gpt_oss",
}
# Families routed DeepSeek-style: sigmoid scores + expert bias, groups, shared experts, dense
# first layers (megarl/models/hf/config_deepseek.py reads their fields).
DEEPSEEK_STYLE = ("glm4_moe", "deepseek_v3")
# Gated DeltaNet hybrids (megarl/models/hf/config_qwen3_next.py reads their fields).
HYBRIDS = ("qwen3_next", "qwen3_5_moe")
# Checkpoints with a vision tower beside the text model megarl trains (kept aside, not trained).
VISION_TOWER = {"qwen3_5_moe": "model.visual."}

# The model dtypes megarl runs; other modules derive their tables from this one.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelArch:
    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: str
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk: bool = True
    router_aux_loss_coef: float = 0.0
    # DeepSeek-style MoE (models/hf/config_deepseek.py); the defaults describe the other families.
    moe_score: str = "softmax"           # softmax | sigmoid
    moe_expert_bias: bool = False        # aux-loss-free balancing bias, added for top-k only
    moe_groups: int = 0                  # group-limited top-k: groups of experts (0: off)
    moe_group_topk: int = 0              # groups each token may use
    moe_scaling: float = 1.0             # routed_scaling_factor on the routed experts' weights
    shared_expert_ffn: int = 0           # width of the shared experts (all of them together)
    first_dense_layers: int = 0          # layers before the first MoE layer use a dense MLP
    mtp_layers: int = 0                  # multi-token-prediction layers the checkpoint stores
    rotary_percent: float = 1.0          # share of each head's dims RoPE rotates (GLM: 0.5)
    # Multi-latent attention (kv_lora_rank > 0); head_dim is then the no-RoPE q/k dim.
    q_lora_rank: int = 0                 # 0: q is one projection (no low-rank q)
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # YaRN RoPE scaling (factor 1: none).
    yarn_factor: float = 1.0
    yarn_original_max_positions: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # Gated DeltaNet hybrids (models/hf/config_qwen3_next.py); the defaults describe the others.
    layer_types: Tuple[str, ...] = ()    # per layer: linear_attention | full_attention (): all full
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    attention_output_gate: bool = False  # full attention's output times sigmoid(a gate from q_proj)
    zero_centered_norm: bool = False     # RMSNorms scale by (1 + weight)
    shared_expert_gate: bool = False     # the shared expert's output times sigmoid(x . gate)
    yarn_truncate: bool = True           # correction range rounded to whole dims (gpt-oss: false)
    # gpt-oss (models/hf/config_gpt_oss.py); the defaults describe the other families.
    attention_sinks: bool = False        # a learned per-head logit joins each softmax
    sliding_window: int = 0              # tokens a sliding layer sees, itself included (0: none)
    window_layers: Tuple[bool, ...] = () # per layer: sliding (True) or full attention
    linear_bias: bool = False            # attention out, router and expert linears carry biases
    swiglu_alpha: float = 0.0            # 0: silu(gate) * up; else clamped gate*sigmoid(a*gate)*(up+1)
    swiglu_limit: float = 0.0            # clamp of gate (above) and up (both sides); 0: none
    experts_mxfp4: bool = False          # the checkpoint stores routed experts as MXFP4 blocks
    # Block FP8 (models/hf/fp8_blocks.py): the checkpoint's (rows, cols) block; (): unquantized.
    # Read dequantized into `dtype` (models/hf/fp8_reader.py); the model itself is not FP8.
    fp8_block: Tuple[int, ...] = ()

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def __post_init__(self):  # read back from JSON the per-layer fields are lists
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "window_layers", tuple(self.window_layers))
        object.__setattr__(self, "fp8_block", tuple(self.fp8_block))

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and layer >= self.first_dense_layers

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def load_hf_config(hf_dir: str) -> Dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {hf_dir!r}: pass the directory of an HF checkpoint")
    with open(path) as f:
        return json.load(f)


def _rope_theta(cfg: Dict[str, Any], allowed=("default",)) -> float:
    rope = rope_settings(cfg)
    if rope["rope_type"] not in allowed:
        raise _unsupported("rope_type", rope["rope_type"], " or ".join(repr(a) for a in allowed) +
                           " RoPE for this family")
    return float(rope["rope_theta"])


def arch_from_hf_config(cfg: Dict[str, Any]) -> ModelArch:
    """Validate an HF config dict and describe the model; unsupported fields raise ValueError."""
    architectures = cfg.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architectures {architectures!r}: megarl supports one of "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    architecture = architectures[0]
    family = SUPPORTED_ARCHITECTURES[architecture]
    if family in VISION_TOWER:
        cfg = hf_config_qwen3_next.text_model(cfg)
    _require(cfg, "hidden_act", ("silu",), "silu")
    _require(cfg, "mlp_bias", (False, None))
    _require(cfg, "use_sliding_window", (False, None))
    if family == "mixtral":
        _require(cfg, "sliding_window", (None,))
    if family not in ("qwen2", "glm4_moe", "gpt_oss"):
        _require(cfg, "attention_bias", (False, None))
    fp8_block = ()
    if family == "gpt_oss":
        hf_config_gpt_oss.check_quantization(cfg)
    else:  # block FP8 as published (DeepSeek-V3, Kimi-K2, Qwen3 -FP8); other formats refused by name
        fp8_block = fp8_blocks.block_size(cfg.get("quantization_config")) or ()
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if family == "deepseek_v3":
        head_dim = int(cfg["qk_nope_head_dim"])
    if family == "qwen2" and head_dim * heads != hidden:
        # transformers honours head_dim for Qwen2, vLLM derives it from hidden_size: the two
        # would compute different models from the same weights.
        raise _unsupported("head_dim", head_dim,
                           f"hidden_size / num_attention_heads = {hidden // heads} for Qwen2")
    num_experts = 0
    moe = {}
    if family == "qwen3_moe":
        _require(cfg, "decoder_sparse_step", (1,), 1)
        _require(cfg, "mlp_only_layers", ([], None))
        num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
        moe = dict(moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                   moe_norm_topk=bool(cfg.get("norm_topk_prob", False)))
    elif family == "mixtral":
        num_experts = int(cfg["num_local_experts"])
        # Mixtral's softmax over all experts then renormalized top-k equals top-k then softmax.
        moe = dict(moe_ffn_hidden_size=int(cfg["intermediate_size"]), moe_norm_topk=True)
    elif family in DEEPSEEK_STYLE:
        num_experts = int(cfg["n_routed_experts"])
        moe = hf_config_deepseek.routing(cfg, num_experts)
    elif family in HYBRIDS:
        num_experts = int(cfg["num_experts"])
        moe = hf_config_qwen3_next.moe(cfg)
    elif family == "gpt_oss":
        num_experts = int(cfg["num_local_experts"])
        moe = hf_config_gpt_oss.experts(cfg)
    if num_experts:
        moe.update(num_experts=num_experts, moe_topk=int(cfg["num_experts_per_tok"]),
                   router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)))
        if moe["moe_norm_topk"] and moe["moe_topk"] == 1:
            # Renormalized top-1 weighs its expert by exactly 1; Megatron-Core's router refuses
            # top-k-then-softmax at k=1, and softmax-then-top-1 would weigh it by its probability.
            raise _unsupported("num_experts_per_tok", 1, "top-k >= 2 when the top-k weights are "
                               "renormalized (Mixtral, norm_topk_prob=true), or norm_topk_prob=false")
    extra = {}
    if family in DEEPSEEK_STYLE:
        extra = hf_config_deepseek.attention(cfg, family, head_dim)
    elif family in HYBRIDS:
        extra = hf_config_qwen3_next.hybrid(cfg, head_dim)
    elif family == "gpt_oss":
        extra = hf_config_gpt_oss.attention(cfg)
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    if dtype not in DTYPES:
        raise _unsupported("dtype", dtype, " or ".join(sorted(DTYPES)))
    return ModelArch(
        family=family,
        architecture=architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP: no intermediate_size
        ffn_hidden_size=int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, ("default", "yarn") if family in ("deepseek_v3", "gpt_oss")
                               else ("default",)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe", *HYBRIDS) or bool(cfg.get("use_qk_norm", False)),
        dtype=dtype,
        fp8_block=fp8_block,
        **moe,
        **extra,
    )


def load_arch(hf_dir: str, dtype: Optional[str] = None) -> ModelArch:
    arch = arch_from_hf_config(load_hf_config(hf_dir))
    if dtype is not None:
        arch = ModelArch(**{**arch.to_dict(), "dtype": dtype})
    return arch


def reward_model_arch(cfg: Dict[str, Any], where: str) -> ModelArch:
    """An HF *ForSequenceClassification config read as the value model's: the trunk of its
    causal-LM family, and one label (the score, held as the value head)."""
    architectures = cfg.get("architectures") or []
    twin = [a[:-len("ForSequenceClassification")] + "ForCausalLM" for a in architectures
            if a.endswith("ForSequenceClassification")]
    if len(architectures) != 1 or not twin or twin[0] not in SUPPORTED_ARCHITECTURES:
        supported = sorted(a.replace("ForCausalLM", "ForSequenceClassification")
                           for a in SUPPORTED_ARCHITECTURES)
        raise ValueError(f"reward model {where!r} has architectures {architectures!r}; a reward model "
                         f"is one of {supported}")
    labels = len(cfg["id2label"]) if cfg.get("id2label") else int(cfg.get("num_labels", 2))
    if labels != 1:
        raise ValueError(f"reward model {where!r} has {labels} labels; a reward model scores with "
                         "one (num_labels=1)")
    return arch_from_hf_config({**cfg, "architectures": twin})
