"""The config.json fields of DeepSeek-style MoE families (DeepSeek-V3/R1, Kimi-K2, GLM-4.5):
routing, shared experts, dense first layers, MTP, multi-latent attention, partial and YaRN RoPE.

Pure functions from the config dict to ModelArch fields; every value megarl cannot compute the
way HF transformers and vLLM do is refused by name.
"""

from typing import Any, Dict

from megarl.models.hf.fields import require, rope_settings, unsupported


def routing(cfg: Dict[str, Any], num_experts: int) -> Dict[str, Any]:
    """Sigmoid scores; top-k on scores + expert bias, within the best groups; renormalized top-k
    weights times routed_scaling_factor; shared experts beside the routed ones."""
    # Published DeepSeek checkpoints name the method; HF's config class does not write it.
    require(cfg, "scoring_func", ("sigmoid",), "sigmoid")
    require(cfg, "topk_method", ("noaux_tc",), "noaux_tc")
    require(cfg, "norm_topk_prob", (True,), True)  # Megatron renormalizes sigmoid top-k always
    require(cfg, "moe_layer_freq", (1,), 1)
    topk = int(cfg["num_experts_per_tok"])
    layers = int(cfg["num_hidden_layers"])
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    if first_dense >= layers:
        raise unsupported("first_k_dense_replace", first_dense,
                          f"fewer dense layers than num_hidden_layers={layers} (at least one MoE layer)")
    shared = int(cfg.get("n_shared_experts") or 0)
    if shared < 1:
        raise unsupported("n_shared_experts", shared, "1 or more shared experts")
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if num_experts % groups:
        raise unsupported("n_group", groups, f"a divisor of n_routed_experts={num_experts}")
    if group_topk > groups:
        raise unsupported("topk_group", group_topk, f"at most n_group={groups}")
    if group_topk == groups:
        groups = group_topk = 0  # every group chosen: plain top-k
    elif topk != 2 * group_topk or num_experts // groups < 2:
        # HF and vLLM rank a group by the sum of its top-2 scores, Megatron-Core by its top
        # (topk / topk_group): they agree only when that is 2.
        raise unsupported("topk_group", group_topk,
                          f"num_experts_per_tok / 2 = {topk / 2:g} when n_group={groups} limits "
                          f"the groups (each group ranked by its top-2 experts, >= 2 per group)")
    return dict(
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        moe_norm_topk=True,
        moe_score="sigmoid",
        moe_expert_bias=True,
        moe_groups=groups,
        moe_group_topk=group_topk,
        moe_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
        shared_expert_ffn=shared * int(cfg["moe_intermediate_size"]),
        first_dense_layers=first_dense,
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )


def attention(cfg: Dict[str, Any], family: str, head_dim: int) -> Dict[str, Any]:
    rope = rope_settings(cfg)
    if family == "glm4_moe":
        # HF's and vLLM's GLM-4.5 rotate half of each head when config.json does not say.
        factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
        rotary_dim = head_dim * factor
        if rotary_dim != int(rotary_dim) or int(rotary_dim) % 2 or rotary_dim <= 0:
            raise unsupported("partial_rotary_factor", factor,
                              f"a factor giving an even number of rotated dims of head_dim={head_dim}")
        return dict(rotary_percent=factor)
    require(cfg, "attention_bias", (False,), False)
    require(cfg, "rope_interleave", (True,), True)  # Megatron's MLA de-interleaves, as DeepSeek's
    fields = dict(q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                  kv_lora_rank=int(cfg["kv_lora_rank"]),
                  qk_rope_dim=int(cfg["qk_rope_head_dim"]),
                  v_head_dim=int(cfg["v_head_dim"]))
    if rope["rope_type"] == "yarn":
        fields.update(_yarn(rope, int(cfg.get("max_position_embeddings", 4096))))
    return fields


def _yarn(rope: Dict[str, Any], max_positions: int) -> Dict[str, Any]:
    if rope.get("attention_factor") is not None:
        raise unsupported("rope_scaling.attention_factor", rope["attention_factor"],
                          "YaRN's attention factor derived from factor, mscale and mscale_all_dim")
    require(rope, "truncate", (True,), True)
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or max_positions / original)
    mscale = float(rope.get("mscale") or 1.0)
    mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0)
    if mscale != 1.0 and not mscale_all_dim:
        # HF then ignores mscale, Megatron-Core applies it: they would compute different models.
        raise unsupported("rope_scaling.mscale", mscale, "1.0 unless mscale_all_dim is set")
    return dict(yarn_factor=factor, yarn_original_max_positions=original,
                yarn_beta_fast=float(rope.get("beta_fast") or 32),
                yarn_beta_slow=float(rope.get("beta_slow") or 1),
                yarn_mscale=mscale, yarn_mscale_all_dim=mscale_all_dim)
