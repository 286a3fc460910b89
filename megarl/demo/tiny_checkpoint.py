"""Tiny random HF checkpoints of every supported family, made locally (nothing is downloaded).

Used by the tests, the demo and the benchmarks. head_dim is 64 because vLLM's CPU attention
rejects smaller heads, and hidden = heads * head_dim because vLLM's Qwen2 ignores `head_dim`.
Weights are drawn with a fixed seed and a larger std than HF's default so
that layouts which mix up rows produce visibly different log-probs.
"""

import json
import os
from typing import Any, Dict

import torch

BASE = dict(vocab_size=250, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
# DeepSeek-style routing exercised fully: 4 groups of 4 experts, 2 groups per token, a dense
# first layer, shared experts, scaled weights, and one MTP layer declared (not trained).
_DEEPSEEK_MOE = dict(n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
                     topk_group=2, first_k_dense_replace=1, moe_intermediate_size=64,
                     routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1)
# Variants that break naive conversion code, named for the tests and benchmarks.
VARIANTS: Dict[str, Dict[str, Any]] = {
    "llama_tied": dict(family="llama", tie_word_embeddings=True),
    "qwen2_gqa1": dict(family="qwen2", num_key_value_heads=1),
    # gpt-oss as published: experts in MXFP4 blocks and scales (quantization_config mxfp4)
    "gpt_oss_mxfp4": dict(family="gpt_oss", experts_mxfp4=True),
    # Block FP8 as DeepSeek-V3 and the Qwen3 -FP8 releases publish it (fp8=True: _to_fp8). MLA's
    # kv_a_proj_with_mqa (512 + 64 = 576 rows, as in DeepSeek-V3) and these experts' 192 rows
    # (columns of down_proj) end in partial 128 x 128 blocks.
    "deepseek_v3_fp8": dict(family="deepseek_v3", fp8=True, mtp_weights=True),
    "qwen3_moe_fp8": dict(family="qwen3_moe", fp8=True, moe_intermediate_size=192),
    # bf16 checkpoints for block-FP8 engines (rollout/vllm/fp8_engine.py): every quantized slice
    # whole 128-row blocks at rollout TP2 (expert width 256, KV heads of 128 rows per rank,
    # q_lora_rank 128), as vLLM requires; two layers (DeepSeek: a dense one, then MoE).
    "qwen3_moe_fp8_engine": dict(family="qwen3_moe", moe_intermediate_size=256,
                                 num_key_value_heads=4, num_hidden_layers=2),
    "deepseek_v3_fp8_engine": dict(family="deepseek_v3", moe_intermediate_size=256,
                                   q_lora_rank=128, num_hidden_layers=2),
}
FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=False, router_aux_loss_coef=0.0),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                    router_aux_loss_coef=0.0),
    "glm4_moe": dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
                     **_DEEPSEEK_MOE, partial_rotary_factor=0.5, use_qk_norm=True,
                     attention_bias=True),
    # vLLM's CPU MLA decode kernel takes only DeepSeek's own latent shapes (kv_lora_rank 512 +
    # RoPE dim 64), so those stay real; YaRN as DeepSeek-V3 scales it (mscale_all_dim set).
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        **_DEEPSEEK_MOE, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=64, v_head_dim=64, num_key_value_heads=4,
                        rope_scaling=dict(type="yarn", factor=4.0,
                                          original_max_position_embeddings=64, beta_fast=32,
                                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
                        # Published checkpoints say so; vLLM loads the expert bias only then.
                        topk_method="noaux_tc", scoring_func="sigmoid",
                        # As transformers' save_pretrained writes it, as users often start RL
                        # from it: the MTP layer declared, its weights absent (GLM-4.5's stored).
                        mtp_weights=False),
    # Gated DeltaNet hybrid: three linear-attention layers, then gated full attention; linear
    # key/value heads of 64 (vLLM's CPU kernels refuse 32); MoE with a gated shared expert.
    "qwen3_next": dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                       layer_types=["linear_attention"] * 3 + ["full_attention"],
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                       linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=128, norm_topk_prob=True,
                       partial_rotary_factor=0.25, router_aux_loss_coef=0.0),
    # Sinks in every layer, a 16-token window on the even layers (sequences of the tests are
    # longer), YaRN without truncation as gpt-oss publishes it.
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                    sliding_window=16, router_aux_loss_coef=0.0,
                    rms_norm_eps=1e-5,  # vLLM's gpt-oss hard-codes it
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                         original_max_position_embeddings=64, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False)),
}
# Qwen3.5-MoE: Qwen3-Next's text model (its own linear-attention projections) beside a tiny vision
# tower, which megarl keeps aside; the text fields go into text_config.
FAMILIES["qwen3_5_moe"] = {**FAMILIES["qwen3_next"], "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                           "model_type": "qwen3_5_moe",
                           "vision_config": dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                                                 out_hidden_size=256, patch_size=16, spatial_merge_size=2,
                                                 temporal_patch_size=2)}

ZERO_CENTERED_NORMS = ("qwen3_next", "qwen3_5_moe")


def make_tiny_checkpoint(family: str, out_dir: str, seed: int = 0, std: float = 0.08,
                         dtype: str = "float32", fp8: bool = False, **overrides) -> str:
    """Write config.json + model.safetensors of a random `family` model; return out_dir. With
    num_nextn_predict_layers set, mtp_weights=False leaves the MTP layer's weights out. `dtype`
    (float32 or bfloat16): the weights drawn in fp32, stored rounded to it, config.json saying it.
    fp8: the linear weights as block-FP8 codes and scales in several shards (_to_fp8)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    if fp8 and family == "gpt_oss":
        raise ValueError("gpt-oss is published with MXFP4 experts, not block FP8: use the "
                         "gpt_oss_mxfp4 variant")
    fields = {**BASE, **FAMILIES[family], **overrides}
    mtp_weights = fields.pop("mtp_weights", True)
    experts_mxfp4 = fields.pop("experts_mxfp4", False)
    config_cls = transformers.CONFIG_MAPPING[fields["model_type"]]
    kwargs = {k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
    if family == "qwen3_moe":
        kwargs["num_local_experts"] = kwargs.pop("num_experts")  # transformers 5 name
    published = {k: kwargs.pop(k) for k in ("topk_method", "scoring_func") if k in kwargs}
    model_class = transformers.AutoModelForCausalLM
    if "vision_config" in kwargs:  # a vision-language checkpoint: the text model's fields nested
        vision, tied = kwargs.pop("vision_config"), kwargs.pop("tie_word_embeddings")
        kwargs = dict(text_config=kwargs, vision_config=vision, tie_word_embeddings=tied)
        model_class = transformers.AutoModelForImageTextToText
    config = config_cls(**kwargs, architectures=fields["architectures"])
    torch.manual_seed(seed)
    model = model_class.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                # Qwen3-Next's RMSNorms scale by (1 + weight), except its linear attention's
                offset = 0.0 if family in ZERO_CENTERED_NORMS and not any(
                    part in name for part in ("linear_attn", "visual")) else 1.0
                param.copy_(offset + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # HF starts it at zero
                buffer.copy_(0.05 * torch.randn_like(buffer))
    model.to(getattr(torch, dtype)).save_pretrained(out_dir, safe_serialization=True)
    if published:
        _add_to_config(out_dir, published)
    if experts_mxfp4:
        _experts_to_mxfp4(out_dir)
    if fields.get("num_nextn_predict_layers") and mtp_weights:
        _add_mtp_layer(out_dir, fields["num_hidden_layers"], std)
    if fp8:
        _to_fp8(out_dir, family, fields["num_hidden_layers"])
    return out_dir


# quantization_config as DeepSeek-V3/R1 and the Qwen3 -FP8 releases write it; the Qwen3 MoE ones
# also list lm_head and every layer's router in modules_to_not_convert.
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [128, 128]}
FP8_SHARDS = 3


def _to_fp8(out_dir: str, family: str, num_layers: int) -> None:
    """Store the checkpoint as a published block-FP8 one: the tensors fp8_blocks.is_quantized
    names as float8_e4m3fn codes + fp32 `weight_scale_inv`, the rest as they were, in
    FP8_SHARDS shards by layer (model-0000k-of-0000N.safetensors) with an index."""
    import re

    from safetensors.torch import load_file, save_file

    from megarl.models.hf import fp8_blocks

    config = dict(FP8_CONFIG)
    if family == "qwen3_moe":
        config["modules_to_not_convert"] = ["lm_head"] + [f"model.layers.{i}.mlp.gate"
                                                           for i in range(num_layers)]
    index = os.path.join(out_dir, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.isfile(index) \
        else ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(out_dir, name)))
        os.remove(os.path.join(out_dir, name))
    stored = {}
    for name, tensor in tensors.items():
        if fp8_blocks.is_quantized(name, tuple(tensor.shape), config):
            stored[name], stored[fp8_blocks.scale_name(name)] = fp8_blocks.quantize(tensor.float())
        else:
            stored[name] = tensor
    layers = num_layers + 1  # the MTP layers (and the final norm, the head) in the last shard

    def shard_of(name: str) -> int:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        layer = int(match.group(1)) if match else (0 if "embed_tokens" in name else layers - 1)
        return min(layer, layers - 1) * FP8_SHARDS // layers

    weight_map, total = {}, 0
    for k in range(FP8_SHARDS):
        filename = f"model-{k + 1:05d}-of-{FP8_SHARDS:05d}.safetensors"
        shard = {n: t.contiguous() for n, t in stored.items() if shard_of(n) == k}
        save_file(shard, os.path.join(out_dir, filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                  sort_keys=True)
    _add_to_config(out_dir, {"quantization_config": config})


def _add_to_config(out_dir: str, fields: Dict[str, Any]) -> None:
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **fields}, f, indent=2)


def _experts_to_mxfp4(out_dir: str) -> None:
    """Store the fused experts (gpt-oss) as MXFP4 blocks and scales, as OpenAI publishes them."""
    from safetensors.torch import load_file, save_file

    from megarl.models.hf.fused_experts import MXFP4_CONFIG, quantize_mxfp4

    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensors.pop(name))
    save_file(tensors, path, metadata={"format": "pt"})
    _add_to_config(out_dir, {"quantization_config": MXFP4_CONFIG})


def _add_mtp_layer(out_dir: str, num_layers: int, std: float) -> None:
    """What published DeepSeek-V3 / GLM-4.5 checkpoints store and HF transformers does not
    build: an MTP layer at index num_layers (a decoder layer plus its projections and head), in
    a second file with an index, as a sharded checkpoint is laid out."""
    from safetensors.torch import load_file, save_file

    main = load_file(os.path.join(out_dir, "model.safetensors"))
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    tensors = {mtp + name[len(last):]: torch.randn_like(t) * std
               for name, t in main.items() if name.startswith(last)}
    hidden, dtype = main["model.norm.weight"].shape[0], main["model.norm.weight"].dtype
    tensors.update({mtp + "enorm.weight": torch.ones(hidden, dtype=dtype),
                    mtp + "hnorm.weight": torch.ones(hidden, dtype=dtype),
                    mtp + "eh_proj.weight": (torch.randn(hidden, 2 * hidden) * std).to(dtype),
                    mtp + "shared_head.norm.weight": torch.ones(hidden, dtype=dtype)})
    save_file(tensors, os.path.join(out_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
    os.rename(os.path.join(out_dir, "model.safetensors"), os.path.join(out_dir, "model-main.safetensors"))
    weight_map = {**{n: "model-main.safetensors" for n in main},
                  **{n: "model-mtp.safetensors" for n in tensors}}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def make_named(name: str, out_dir: str, seed: int = 0, dtype: str = "float32", **overrides) -> str:
    """A family name or a VARIANTS name; `overrides`: config fields over the name's own."""
    if name in VARIANTS:
        fields = {**VARIANTS[name], **overrides}
        return make_tiny_checkpoint(fields.pop("family"), out_dir, seed=seed, dtype=dtype, **fields)
    return make_tiny_checkpoint(name, out_dir, seed=seed, dtype=dtype, **overrides)
