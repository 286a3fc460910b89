"""Where every weight goes: the tensors each destination rank holds, as slabs of full Megatron
tensors.

A destination layout is, for every rank that receives weights, the list of tensors it holds (a
vLLM engine rank's own parameters, or the HF tensors an exporter writes), each described by the
slabs of canonical full-model Megatron tensors (weight_tables names) it is made of. Pure functions
of the model architecture and the rollout layout (here, below both, as weight_tables is): the
sync plan (resharding/plan.py) intersects them with the pieces the training ranks hold, the
cluster planner (scripts/plan_sync.py) runs the same code without any weights, and an engine that
merges LoRA adapters itself finds their rows here (rollout/vllm/merge.py). The engine checks at
its first sync that these are exactly the parameters it really has (names and shapes), so a vLLM
change cannot slip by silently.

vLLM's layouts written here (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py,
fused_moe/layer.py): QKVParallelLinear holds [its q heads; its kv heads (k); (v)] with KV heads
replicated when the engine TP exceeds them; MergedColumnParallelLinear holds [its gate rows; its
up rows]; FusedMoE holds w13 [local experts, 2 * its width, hidden] (gate then up) and w2 [local
experts, hidden, its width]; vocabulary tensors are padded to a multiple of 64 rows, then split.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megarl.models.hf.config import ModelArch
from megarl.models.weights import destination_hybrid as hybrid
from megarl.models.weights import tables as weight_tables

# Megatron and vLLM split their columns (out_proj: Gated DeltaNet's)
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight", "self_attention.out_proj.weight")
VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Region:
    """Rows [start, start + length) along `dim` of full Megatron tensor `canonical` (all of its
    other dimensions), written at `dst_start` along the same dim of the destination tensor, or of
    its `expert`-th slice for fused expert weights."""
    canonical: str
    dim: int
    start: int
    length: int
    dst_start: int
    expert: Optional[int] = None
    step: int = 1  # destination rows this far apart (vLLM's gpt-oss interleaves gate and up rows)


@dataclass(frozen=True)
class DestTensor:
    name: str                  # the engine's parameter name (or the HF tensor name)
    shape: Tuple[int, ...]
    regions: Tuple[Region, ...]
    fp8: bool = False          # block FP8 in the engine (fp8_layout.quantized_layout)
    fp32: bool = False         # fp32 in the engine whatever the model's dtype (engine_fp32.fp32_layout)

    @property
    def module(self) -> str:
        """Tensors of one module are written together: the engine finishes a module at once."""
        return self.name.rsplit(".", 1)[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def engine_bytes(self, itemsize: int) -> int:
        """Its bytes in the engine unquantized, `itemsize` the model dtype's."""
        return self.numel * (4 if self.fp32 else itemsize)

    @property
    def covered(self) -> int:
        """Elements the regions write; the rest (vocabulary padding rows) must be zeroed."""
        total = 0
        for region in self.regions:
            inner = self.shape[1:] if region.expert is not None else self.shape
            total += region.length * math.prod(inner) // inner[region.dim]
        return total


@dataclass(frozen=True)
class RolloutLayout:
    """The engines' layout: independent engines of `size` consecutive ranks each. Attention and
    dense layers are split over `tp` ranks; experts are split over all `ep` ranks of the engine
    (vLLM's expert parallelism: ep = tp x its data-parallel attention replicas), or with ep 1
    every expert's width is split over the tp ranks."""
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"rollout tp must be >= 1, got {self.tp}")
        if self.ep < 1 or (self.ep > 1 and self.ep % self.tp):
            raise ValueError(f"rollout ep {self.ep}: vLLM's expert parallelism spans its tp x "
                             f"data-parallel ranks, so rollout ep must be 1 or a multiple of the "
                             f"rollout tp ({self.tp})")

    @property
    def size(self) -> int:
        return max(self.tp, self.ep)

    def engines(self, world: int, first_rank: int = 0) -> Tuple[Tuple[int, ...], ...]:
        """Each engine's ranks, the first at `first_rank`."""
        return tuple(tuple(range(first_rank + start, first_rank + start + self.size))
                     for start in range(0, world, self.size))


# Multi-latent attention (DeepSeek): vLLM splits these over its TP ranks by whole heads, as
# Megatron's column-parallel linears do; the down projections are replicated, and with a low-rank
# q vLLM fuses them into one `fused_qkv_a_proj` (q_a rows, then kv_a rows).
MLA_HEAD_SPLIT = ("linear_q_up_proj.weight", "linear_q_proj.weight", "linear_kv_up_proj.weight")
_MLA_DOWN = {"linear_q_down_proj.weight": "q_a_proj", "linear_kv_down_proj.weight": "kv_a_proj_with_mqa"}


def _mla_shape(arch: ModelArch, canonical: str) -> Optional[Tuple[int, ...]]:
    h, heads, d, rope = arch.hidden_size, arch.num_heads, arch.head_dim, arch.qk_rope_dim
    table = (("linear_q_down_proj.weight", (arch.q_lora_rank, h)),
             ("linear_kv_down_proj.weight", (arch.kv_lora_rank + rope, h)),
             ("linear_q_up_proj.weight", (heads * (d + rope), arch.q_lora_rank)),
             ("linear_q_proj.weight", (heads * (d + rope), h)),
             ("linear_kv_up_proj.weight", (heads * (d + arch.v_head_dim), arch.kv_lora_rank)),
             ("self_attention.linear_proj.weight", (h, heads * arch.v_head_dim)),
             ("q_layernorm.weight", (arch.q_lora_rank,)), ("kv_layernorm.weight", (arch.kv_lora_rank,)))
    return next((shape for suffix, shape in table if canonical.endswith(suffix)), None)


def full_shape(arch: ModelArch, canonical: str) -> Tuple[int, ...]:
    """Shape of one full Megatron tensor, vocabulary unpadded (regions never reach padding)."""
    if arch.mla and (shape := _mla_shape(arch, canonical)) is not None:
        return shape
    if arch.layer_types and (shape := hybrid.hybrid_shape(arch, canonical)) is not None:
        return shape
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    ffn = arch.moe_ffn_hidden_size if ".experts." in canonical else arch.ffn_hidden_size
    if ".shared_experts." in canonical:
        ffn = arch.shared_expert_ffn
    table = (("word_embeddings.weight", (arch.vocab_size, h)), ("output_layer.weight", (arch.vocab_size, h)),
             ("router.expert_bias", (arch.num_experts,)), ("router.bias", (arch.num_experts,)),
             ("softmax_offset", (arch.num_heads,)), ("linear_proj.bias", (h,)),
             ("linear_fc1.bias", (2 * ffn,)), ("linear_fc2.bias", (h,)),
             ("linear_qkv.weight", (qkv, h)), ("linear_qkv.bias", (qkv,)),
             ("linear_proj.weight", (h, arch.num_heads * d)), ("layernorm.weight", None),
             ("linear_fc1.weight", (2 * ffn, h)), ("linear_fc2.weight", (h, ffn)),
             ("router.weight", (arch.num_experts, h)))
    for suffix, shape in table:
        if canonical.endswith(suffix):
            if shape is None:  # q/k norms act on one head, the others on the hidden state
                return (d,) if canonical.endswith(("q_layernorm.weight", "k_layernorm.weight")) else (h,)
            return shape
    raise KeyError(f"no shape rule for Megatron tensor {canonical!r}")


def _whole(canonical: str, shape: Tuple[int, ...]) -> Region:
    """The whole tensor, as one slab along the dimension Megatron's TP shards it (rows for
    column-parallel and vocabulary tensors, columns for row-parallel ones), so every shard of it
    is a slab of that region."""
    dim = 1 if canonical.endswith(ROW_PARALLEL) else 0
    return Region(canonical, dim, 0, shape[dim], 0)


def _runs(rows: List[int], length: int) -> List[Tuple[int, int, int]]:
    """(full start, destination start, length) runs of consecutive `length`-row blocks."""
    runs = []
    for i, row in enumerate(rows):
        if runs and runs[-1][0] + runs[-1][2] == row:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
        else:
            runs.append((row, i * length, length))
    return runs


def _qkv_rows(arch: ModelArch, q_heads: range, kv_heads: range, part: str) -> List[int]:
    """First full-tensor row of each head of `part` (q, k, v) among the given heads. Megatron
    groups rows per KV head: [q heads of group g, k_g, v_g] (weight_transforms.merge_qkv)."""
    per_group = arch.num_heads // arch.num_kv_heads
    group = (per_group + 2) * arch.head_dim
    if part == "q":
        return [(h // per_group) * group + (h % per_group) * arch.head_dim for h in q_heads]
    offset = (per_group + (part == "v")) * arch.head_dim
    return [g * group + offset for g in kv_heads]


def _engine_heads(arch: ModelArch, tp: int, t: int) -> Tuple[range, range]:
    q = arch.num_heads // tp
    if arch.num_kv_heads >= tp:
        kv = arch.num_kv_heads // tp
        return range(t * q, (t + 1) * q), range(t * kv, (t + 1) * kv)
    replicas = tp // arch.num_kv_heads  # vLLM replicates each KV head on `replicas` ranks
    return range(t * q, (t + 1) * q), range(t // replicas, t // replicas + 1)


def _rows(canonical: str, runs, dim: int = 0, expert: Optional[int] = None) -> List[Region]:
    return [Region(canonical, dim, start, length, dst, expert) for start, dst, length in runs]


# vLLM's module names where its model differs from the HF checkpoint's (its hf_to_vllm_mapper).
VLLM_RENAMES = {"gpt_oss": ((".self_attn.", ".attn."), ("model.embed_tokens.", "model.embedding."))}


def _vllm_name(entry: weight_tables.Entry, family: str = "") -> str:
    name = entry.hf[0]
    if entry.transform == "qkv":
        name = name.replace("q_proj", "qkv_proj")
    if entry.transform == "gate_up" and ".experts." not in entry.megatron:
        name = name.replace("gate_proj", "gate_up_proj")
    for old, new in VLLM_RENAMES.get(family, ()):
        name = name.replace(old, new)
    return name


def _interleaved_experts(c: str, name: str, shape: Tuple[int, ...], local: int, w: int, u: int,
                         t: int, experts_here: int) -> List[Tuple[str, Tuple[int, ...], List[Region]]]:
    """gpt-oss in vLLM: w13 rows (and bias) interleave gate and up ([g0, u0, g1, u1, ...] of this
    rank's slice); the w2 bias is summed over the TP ranks, so only TP rank 0 holds it (vLLM zeroes
    the others': an uncovered tensor is zeroed)."""
    module = name[:name.index(".experts.") + len(".experts")] + ".routed_experts"
    width = shape[0] // 2
    interleaved = [Region(c, 0, u * w, w, 0, local, 2), Region(c, 0, width + u * w, w, 1, local, 2)]
    if c.endswith("linear_fc1.weight"):
        return [(module + ".w13_weight", (experts_here, 2 * w, shape[1]), interleaved)]
    if c.endswith("linear_fc1.bias"):
        return [(module + ".w13_bias", (experts_here, 2 * w), interleaved)]
    if c.endswith("linear_fc2.weight"):
        return [(module + ".w2_weight", (experts_here, shape[0], w), [Region(c, 1, u * w, w, 0, local)])]
    return [(module + ".w2_bias", (experts_here, shape[0]),
             [Region(c, 0, 0, shape[0], 0, local)] if t == 0 or w == width else [])]


def _expert_module(entry: weight_tables.Entry) -> str:
    """'model.layers.3.mlp.experts.7.gate_proj.weight' -> 'model.layers.3.mlp.experts.routed_experts'
    (vLLM's FusedMoE keeps the fused expert weights in its `routed_experts` child)."""
    name = entry.hf[0]
    return name[:name.index(".experts.") + len(".experts")] + ".routed_experts"


def vllm_rank_tensors(arch: ModelArch, rollout: RolloutLayout, p: int,
                      role: str = "policy") -> Tuple[DestTensor, ...]:
    """The parameters engine rank `p` (0 <= p < rollout.size) holds, in weight-table order."""
    tp, t = rollout.tp, p % rollout.tp
    vocab_rows = -(-arch.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // tp
    experts_here = arch.num_experts // rollout.ep
    expert_tp, expert_rank = (1, p) if rollout.ep > 1 else (tp, 0)
    q_heads, kv_heads = _engine_heads(arch, tp, t)
    tensors: Dict[str, Tuple[Tuple[int, ...], List[Region]]] = {}

    def add(name: str, shape: Tuple[int, ...], regions: List[Region]) -> None:
        tensors.setdefault(name, (shape, []))[1].extend(regions)

    for entry in weight_tables.entries(arch, role):
        c, shape = entry.megatron, full_shape(arch, entry.megatron)
        mine = arch.layer_types and hybrid.vllm_tensors(arch, entry.transform, c, entry.hf, shape, tp, t,
                                                        q_heads, kv_heads)
        if mine:
            for name, local_shape, runs in mine:
                add(name, local_shape, [Region(c, 0, start, n, dst) for start, dst, n in runs])
        elif entry.transform == "qkv":
            d = arch.head_dim
            runs = [_runs(_qkv_rows(arch, q_heads, kv_heads, part), d) for part in "qkv"]
            offsets = [0, len(q_heads) * d, (len(q_heads) + len(kv_heads)) * d]
            regions = [Region(c, 0, s, n, off + dst) for run, off in zip(runs, offsets) for s, dst, n in run]
            add(_vllm_name(entry, arch.family), ((len(q_heads) + 2 * len(kv_heads)) * d, *shape[1:]), regions)
        elif ".experts." in c and arch.family == "gpt_oss":
            expert = int(c.split(".local_experts.")[1].split(".")[0])
            if expert // experts_here == expert_rank:
                width = arch.moe_ffn_hidden_size
                for name, dest_shape, regions in _interleaved_experts(
                        c, entry.hf[0], shape, expert % experts_here, width // expert_tp,
                        t % expert_tp, t, experts_here):
                    add(name, dest_shape, regions)
        elif c.endswith("core_attention.softmax_offset"):  # sinks: split with the heads
            n = arch.num_heads // tp
            add(_vllm_name(entry, arch.family), (n,), [Region(c, 0, t * n, n, 0)])
        elif ".experts." in c:
            expert = int(c.split(".local_experts.")[1].split(".")[0])
            if expert // experts_here != expert_rank:
                continue
            local, width = expert % experts_here, shape[0] // 2 if "fc1" in c else shape[1]
            w, u = width // expert_tp, t % expert_tp
            module = _expert_module(entry)
            if "fc1" in c:
                add(module + ".w13_weight", (experts_here, 2 * w, shape[1]),
                    [Region(c, 0, u * w, w, 0, local), Region(c, 0, width + u * w, w, w, local)])
            else:
                add(module + ".w2_weight", (experts_here, shape[0], w), [Region(c, 1, u * w, w, 0, local)])
        elif c.endswith(tuple(_MLA_DOWN)) and arch.q_lora_rank:
            q_rows = arch.q_lora_rank
            fused = (q_rows + arch.kv_lora_rank + arch.qk_rope_dim, shape[1])
            dst = 0 if c.endswith("linear_q_down_proj.weight") else q_rows
            add(entry.hf[0].replace(_MLA_DOWN[c[c.rindex("linear_"):]], "fused_qkv_a_proj"), fused,
                [Region(c, 0, 0, shape[0], dst)])
        elif c.endswith(MLA_HEAD_SPLIT):
            rows = shape[0] // tp
            add(_vllm_name(entry, arch.family), (rows, shape[1]), [Region(c, 0, t * rows, rows, 0)])
        elif entry.transform == "gate_up":
            f = shape[0] // 2 // tp
            add(_vllm_name(entry, arch.family), (2 * f, shape[1]),
                [Region(c, 0, t * f, f, 0), Region(c, 0, shape[0] // 2 + t * f, f, f)])
        elif entry.transform == "vocab":
            start = t * vocab_rows
            n = max(0, min(arch.vocab_size - start, vocab_rows))
            add(_vllm_name(entry, arch.family), (vocab_rows, shape[1]),
                [Region(c, 0, start, n, 0)] if n else [])
        elif c.endswith(ROW_PARALLEL):
            cols = shape[1] // tp
            add(_vllm_name(entry, arch.family), (shape[0], cols), [Region(c, 1, t * cols, cols, 0)])
        else:
            add(_vllm_name(entry, arch.family), shape, [_whole(c, shape)])
    return tuple(DestTensor(name, shape, tuple(regions)) for name, (shape, regions) in tensors.items())


def hf_tensors(arch: ModelArch, role: str = "policy") -> Tuple[DestTensor, ...]:
    """Every HF checkpoint tensor, whole: the layout an exporter writes."""
    out = []
    for entry in weight_tables.entries(arch, role):
        c, shape = entry.megatron, full_shape(arch, entry.megatron)
        if entry.transform == "qkv":
            heads = range(arch.num_heads), range(arch.num_kv_heads)
            for name, part in zip(entry.hf, "qkv"):
                rows = _qkv_rows(arch, *heads, part)
                out.append(DestTensor(name, (len(rows) * arch.head_dim, *shape[1:]),
                                      tuple(_rows(c, _runs(rows, arch.head_dim)))))
        elif entry.transform in ("gated_qkv", "qkvzba"):
            rows = (hybrid.gated_qkv_rows if entry.transform == "gated_qkv" else hybrid.qkvzba_rows)(arch)
            out += [DestTensor(name, (sum(n for _, _, n in runs), *shape[1:]),
                               tuple(Region(c, 0, start, n, dst) for start, dst, n in runs))
                    for name, runs in zip(entry.hf, rows)]
        elif entry.transform == "qkv_z_b_a":
            starts = [0]
            for size in weight_tables.qkv_z_b_a_sizes(arch):
                starts.append(starts[-1] + size)
            out += [DestTensor(name, (end - start, *shape[1:]), (Region(c, 0, start, end - start, 0),))
                    for name, start, end in zip(entry.hf, starts, starts[1:])]
        elif entry.transform == "gate_up":
            half = shape[0] // 2
            out += [DestTensor(name, (half, *shape[1:]), (Region(c, 0, i * half, half, 0),))
                    for i, name in enumerate(entry.hf)]
        else:
            out.append(DestTensor(entry.hf[0], shape, (_whole(c, shape),)))
    return tuple(out)


def vllm_layout(arch: ModelArch, rollout: RolloutLayout, world: int,
                role: str = "policy") -> Dict[int, Tuple[DestTensor, ...]]:
    """Every rank's engine tensors: rank r is engine rank r % size of engine r // size."""
    check_rollout(arch, rollout, world)
    per_position = [vllm_rank_tensors(arch, rollout, p, role) for p in range(rollout.size)]
    return {rank: per_position[rank % rollout.size] for rank in range(world)}


def check_rollout(arch: ModelArch, rollout: RolloutLayout, world: int) -> None:
    """The divisibility vLLM itself requires of the engine layout, with the fix named."""
    problems = []
    if world % rollout.size:
        what = f"rollout tp {rollout.tp}" if rollout.ep == 1 else f"the engine size {rollout.size} (ep)"
        problems.append(f"{what} must divide the world size {world}")
    if arch.num_heads % rollout.tp:
        problems.append(f"rollout tp {rollout.tp} must divide the {arch.num_heads} attention heads")
    if arch.num_kv_heads % rollout.tp and rollout.tp % arch.num_kv_heads:
        problems.append(f"rollout tp {rollout.tp} must divide the {arch.num_kv_heads} KV heads or "
                        "be a multiple of them (vLLM then replicates each KV head)")
    elif arch.num_kv_heads % rollout.tp and arch.family == "gpt_oss":
        problems.append(f"rollout tp {rollout.tp} must divide the {arch.num_kv_heads} KV heads: "
                        "vLLM's gpt-oss does not replicate KV heads")
    dense_layers = not arch.num_experts or arch.first_dense_layers
    if dense_layers and arch.ffn_hidden_size % rollout.tp:
        problems.append(f"rollout tp {rollout.tp} must divide intermediate_size {arch.ffn_hidden_size}")
    if arch.linear_key_heads % rollout.tp:  # vLLM's Gated DeltaNet splits whole key heads
        problems.append(f"rollout tp {rollout.tp} must divide the {arch.linear_key_heads} linear-attention "
                        "key heads (linear_num_key_heads)")
    if arch.shared_expert_ffn % rollout.tp:
        problems.append(f"rollout tp {rollout.tp} must divide the shared experts' width "
                        f"{arch.shared_expert_ffn}")
    if arch.num_experts and rollout.ep > 1 and arch.num_experts % rollout.ep:
        problems.append(f"rollout ep {rollout.ep} must divide the {arch.num_experts} experts")
    if arch.num_experts and rollout.ep == 1 and arch.moe_ffn_hidden_size % rollout.tp:
        problems.append(f"rollout tp {rollout.tp} must divide moe_intermediate_size "
                        f"{arch.moe_ffn_hidden_size} (vLLM splits every expert over its TP ranks; "
                        "or set rollout ep to split the experts instead)")
    if problems:
        raise ValueError("layout: " + "; ".join(problems))
