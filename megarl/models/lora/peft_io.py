"""LoRA adapters in PEFT's folder format, in and out of megarl's Megatron models.

A PEFT LoRA folder holds adapter_config.json (r, lora_alpha, target_modules, ...) and
adapter_model.safetensors with one lora_A [r, in] and one lora_B [out, r] per HF module, named
`base_model.model.<HF module>.lora_A.weight`. megarl's adapters (models/lora/adapters.py) hold the same
matrices, cut for the layout, so loading cuts and saving joins: no arithmetic, and PEFT -> megarl
-> PEFT is bit-exact.

A folder may adapt any projections, each with its own rank and alpha (rank_pattern, alpha_pattern),
read from its tensors: q_proj and v_proj without k_proj adapt those two of megarl's fused
linear_qkv. read_config refuses, naming the field, what megarl's adapters do not run (DoRA, bias
training, modules_to_save, other PEFT methods, some layers only) and target_modules entries that
name no module of the model, before any model is built. A saved folder keeps the user's own
target_modules, target_parameters and patterns (config.init's folder), else names the adapted
projections itself (peft_targets).
"""

import json
import os
import re
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megarl.models.hf.config import ModelArch
from megarl.models.lora.adapters import (
    EXPERT_ORDER,
    KINDS,
    LoraAdapter,
    LoraConfig,
    adapters,
    attach,
    chosen_parts,
    expert_of,
    kind_of,
    kinds_of,
    projections,
)
from megarl.models.weights.tables import entries

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_key(hf_module: str, which: str, nest: int = 0) -> str:
    return f"{PREFIX}{hf_module}.{'base_layer.' * nest}lora_{which}.weight"


def _key(adapter: LoraAdapter, short: str, which: str) -> str:
    """PEFT's name of the A or B this adapter part is (a routed expert's: is a slice of)."""
    return peft_key(adapter.hf_names[short], which, adapter.expert[1] if adapter.expert else 0)


def expert_slice(full: torch.Tensor, which: str, expert: int, experts: int) -> torch.Tensor:
    """Expert `expert`'s A [r, in] or B [out, r] out of PEFT's adapter on a fused expert
    parameter: A [experts * r, in] stacks the experts' A; B [out, r * experts] interleaves their
    columns (PEFT's ParamWrapper reshapes it to [out, r, experts])."""
    if which == "A":
        return full.reshape(experts, -1, full.shape[-1])[expert]
    return full.reshape(full.shape[0], -1, experts)[..., expert]


def _stack_experts(pieces: Dict[int, torch.Tensor], which: str) -> torch.Tensor:
    ordered = [pieces[e] for e in sorted(pieces)]
    if which == "A":
        return torch.cat(ordered, dim=0)
    return torch.stack(ordered, dim=-1).flatten(1)


# The adapter_config.json fields of PEFT features megarl's adapters do not run, with their plain
# values: DoRA, bias training (the base's, or LoRA's own on B), extra trained modules or tokens,
# adapters on some layers only, duplicated layers.
PLAIN_FIELDS = (("use_dora", False), ("bias", "none"), ("lora_bias", False), ("modules_to_save", None),
                ("trainable_token_indices", None), ("layers_to_transform", None),
                ("layer_replication", None))
# What PEFT's config says about which modules and ranks, kept as the user wrote it when a run's
# adapters came from a folder (write_folder)
TARGET_FIELDS = ("target_modules", "target_parameters", "rank_pattern", "alpha_pattern")
PartModules = Dict[Tuple[str, str], List[str]]  # part_modules: {(kind, projection): its HF modules}


def part_modules(arch: ModelArch) -> PartModules:
    """{(kind, projection): every HF module it stands for, layer by layer} on this model; a routed
    expert kind's is the layer's fused parameter (`model.layers.N.mlp.experts.gate_up_proj`, as
    PEFT's target_parameters and rank_pattern name it)."""
    present = {kind: KINDS[kind] for kind in kinds_of(arch)}
    modules: PartModules = {}
    for entry in entries(arch):
        kind = kind_of(present, entry.megatron)
        if kind is None:
            continue
        if KINDS[kind].expert:
            names = {KINDS[kind].expert: f"{expert_of(entry.megatron)[0]}.{KINDS[kind].expert}"}
        else:
            names = {hf.rsplit(".", 2)[-2]: hf[:-len(".weight")] for hf in entry.hf}
        for short, module in names.items():
            found = modules.setdefault((kind, short), [])
            if module not in found:
                found.append(module)
    return modules


def _refuse_features(saved: dict, path: str) -> None:
    if saved.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type={saved.get('peft_type')!r}; megarl loads LoRA adapters "
                         "(peft_type 'LORA'), not LoHa, LoKr, IA3 or other PEFT methods")
    for field, plain in PLAIN_FIELDS:
        if saved.get(field, plain) not in (plain, None, {}, []):
            raise ValueError(f"{path}: {field}={saved[field]!r} is not supported; megarl's adapters are "
                             f"plain LoRA on every layer ({field}={plain!r})")


def _peft_matches(target: str, name: str, regex: bool) -> bool:
    """PEFT's rule: a string target_modules is a regex the whole name matches; a list's entry is the
    name or its end."""
    if regex:
        return re.fullmatch(target, name) is not None
    return name == target or name.endswith("." + target)


def _check_targets(saved: dict, arch: ModelArch, path: str, expected: PartModules) -> None:
    """Refuses a target_modules or target_parameters entry that names nothing in this model
    (`expected`: part_modules)."""
    modules = {"lm_head"}  # every causal LM has one (tied: the embedding's weight)
    for entry in entries(arch):
        for hf in entry.hf:
            parts = hf.split(".")[:-1]
            modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    parameters = {module for (kind, _), found in expected.items() if KINDS[kind].expert for module in found}
    for field, names in (("target_modules", modules), ("target_parameters", parameters)):
        value = saved.get(field)
        if value == "all-linear":  # PEFT's own word for every linear but the head
            continue
        regex = isinstance(value, str)
        unmatched = [t for t in ([value] if regex else value or [])
                     if not any(_peft_matches(t, name, regex) for name in names)]
        if unmatched:
            names = sorted({short for _, short in expected})
            raise ValueError(f"{path}: {field} entries {unmatched} match no module of this {arch.family} "
                             f"model; its adaptable projections: {names}")


def read_config(adapter_dir: str, arch: ModelArch) -> LoraConfig:
    """The LoraConfig a PEFT folder was trained with; refuses what megarl's adapters cannot hold,
    naming the field, before any model is built."""
    path = os.path.join(adapter_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{adapter_dir!r} is not a PEFT adapter folder: {CONFIG_FILE} is "
                                "missing (PEFT's save_pretrained writes it)")
    with open(path) as f:
        saved = json.load(f)
    _refuse_features(saved, path)
    expected = part_modules(arch)
    _check_targets(saved, arch, path, expected)
    rank, alpha = int(saved["r"]), float(saved["lora_alpha"])
    found = _file_parts(adapter_dir, arch, saved, alpha, expected)
    targets, ranks, alphas = [], {}, {}
    for kind in kinds_of(arch):
        shorts = [s for s in projections(arch, kind) if (kind, s) in found]
        if not shorts:
            continue
        targets += [kind] if len(shorts) == len(projections(arch, kind)) else [f"{kind}.{s}" for s in shorts]
        for table, default, index in ((ranks, rank, 0), (alphas, alpha, 1)):
            values = {s: found[(kind, s)][index] for s in shorts}
            if len(set(values.values())) == 1:  # one value for the kind's every adapted projection
                values = {kind: next(iter(values.values()))}
            else:
                values = {f"{kind}.{s}": v for s, v in values.items()}
            table.update({key: v for key, v in values.items() if v != default})
    return LoraConfig(rank=rank, alpha=alpha, dropout=float(saved.get("lora_dropout", 0.0)),
                      targets=tuple(targets), rslora=bool(saved.get("use_rslora", False)),
                      kind_ranks=ranks, kind_alphas=alphas)


def _pattern_value(module: str, patterns: Dict[str, float], default: float) -> float:
    """PEFT's *_pattern lookup: the first key that matches the end of the module's name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(value)
    return default


def _file_parts(adapter_dir: str, arch: ModelArch, saved: dict, alpha: float,
                expected: PartModules) -> Dict[Tuple[str, str], tuple]:
    """{(kind, projection): (its rank, its alpha)} of every projection the folder's tensors adapt,
    read from the tensors themselves (target_modules may be a regex; PEFT widens some ranks).
    Refuses tensors that are not LoRA's, modules megarl has no kind for, and a projection adapted
    in some layers only or with ranks or alphas that differ between layers (`expected`:
    part_modules)."""
    present = kinds_of(arch)
    part_of = {module: part for part, modules in expected.items() for module in modules}
    adapted = {name.rsplit(".", 1)[-1] for name in saved.get("target_parameters") or []}
    routed = [kind for kind in EXPERT_ORDER if kind in present and KINDS[kind].expert in adapted]
    seen: Dict[Tuple[str, str], Dict[str, tuple]] = {}  # part -> {module: (rank, alpha)}
    with safe_open(os.path.join(adapter_dir, WEIGHTS_FILE), "pt") as f:
        for key in f.keys():
            if not re.search(r"\.lora_[AB]\.weight$", key):
                raise ValueError(f"{adapter_dir}: {key} is not a LoRA A or B (megarl's adapters are "
                                 "plain LoRA: no DoRA magnitudes, biases, trained modules or tokens)")
            if not key.endswith(".lora_A.weight"):
                continue
            rows = f.get_slice(key).get_shape()[0]
            module = key[len(PREFIX):-len(".lora_A.weight")]
            if re.search(r"\.experts\.\d+\.", module):
                raise ValueError(f"{adapter_dir}: {key} adapts one expert (transformers 4's layout); "
                                 "load the folder into PEFT with transformers 5 and save it again "
                                 "(one adapter per fused expert parameter)")
            if module.endswith(".mlp.experts") or ".mlp.experts.base_layer" in module:
                kind = routed[len(routed) - 1 - module.count("base_layer")] if routed else None
                module = module.split(".base_layer")[0] + "." + (KINDS[kind].expert if kind else "")
                rows //= arch.num_experts
            part = part_of.get(module)
            if part is None:
                raise ValueError(f"{adapter_dir}: {key} adapts a module megarl has no adapter kind for "
                                 f"on {arch.family} (kinds: {present})")
            module_alpha = _pattern_value(module, saved.get("alpha_pattern") or {}, alpha)
            seen.setdefault(part, {})[module] = (rows, module_alpha)
    if not seen:
        raise ValueError(f"{adapter_dir}: {WEIGHTS_FILE} holds no lora_A tensors")
    for (kind, short), modules in seen.items():
        missing = [m for m in expected[(kind, short)] if m not in modules]
        if missing:
            raise ValueError(f"{adapter_dir} adapts {short} in {len(modules)} of the "
                             f"{len(expected[(kind, short)])} modules that have it, not in {missing[:3]}: "
                             "megarl adapts a projection in every layer that has it; give the folder's "
                             "target_modules the projection's name, not some layers' modules")
        first, a = next(iter(modules.items()))
        other, b = next(((m, v) for m, v in modules.items() if v != a), (None, a))
        if other is not None:
            raise ValueError(f"{adapter_dir}: {first} has (rank, alpha) {a} but {other} {b}: megarl gives "
                             "a projection one rank and alpha in every layer (rank_pattern and "
                             "alpha_pattern by projection, not by layer)")
    return {part: next(iter(modules.values())) for part, modules in seen.items()}


def load(chunks: List[torch.nn.Module], adapter_dir: str) -> None:
    """Every adapter of this rank's chunks from the folder's tensors (cut for the layout). Refuses a
    folder that lacks one, has tensors no rank adapts, or a different rank. Collective."""
    tensors = load_file(os.path.join(adapter_dir, WEIGHTS_FILE))
    used = set()
    for adapter in adapters(chunks):
        for short, hf in adapter.hf_names.items():
            for which, params in (("A", adapter.A), ("B", adapter.B)):
                key = _key(adapter, short, which)
                if key not in tensors:
                    raise KeyError(f"{adapter_dir}: no {key}; the run adapts {hf} (lora.targets)")
                full = tensors[key]
                if adapter.expert:
                    full = expert_slice(full, which, adapter.expert[0], adapter.arch.num_experts)
                local = adapter.local(full, which)
                if local.shape != params[short].shape:
                    raise ValueError(f"{adapter_dir}: {key} is {tuple(tensors[key].shape)}, this model's "
                                     f"adapter needs rank {adapter.ranks[short]} (lora.rank)")
                with torch.no_grad():
                    params[short].copy_(local)
                used.add(key)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, used)
    unused = sorted(set(tensors) - set().union(*everyone))
    if unused:
        raise ValueError(f"{adapter_dir} has adapters this run does not place: {unused[:6]} "
                         f"({len(unused)} in all); add their kinds to lora.targets")


@dataclass(frozen=True)
class Shard:
    """One rank's piece of one adapter tensor: of PEFT tensor `key` (a routed expert's slice of it
    when `expert` is set), TP piece `tp_rank` of `tp_size` cut along `dim` (None: whole)."""
    key: str
    expert: Optional[int]
    tp_rank: int
    tp_size: int
    dim: Optional[int]

    @property
    def slot(self) -> tuple:
        """What identifies the bytes: DP and CP replicas (and TP ranks of a whole tensor) hold
        the same ones."""
        return self.key, self.expert, self.tp_rank if self.dim is not None else 0


def local_shards(chunks: List[torch.nn.Module], tensor_of: Callable = None) -> List[tuple]:
    """(Shard, tensor) of every adapter part this rank holds (`tensor_of` picks what: default the
    weights; e.g. lambda p: p.main_grad)."""
    mine = []
    for adapter in adapters(chunks):
        for short in adapter.hf_names:
            for which, params in (("A", adapter.A), ("B", adapter.B)):
                param = params[short]
                tensor = param.detach() if tensor_of is None else tensor_of(param)
                mine.append((Shard(_key(adapter, short, which), adapter.expert[0] if adapter.expert else None,
                                   adapter.tp_rank, adapter.tp_size, adapter.split_dim(which)),
                             tensor.detach()))
    return mine


def assemble(shards) -> Dict[str, torch.Tensor]:
    """Every PEFT tensor whole, from (Shard, tensor) pairs that cover each of them (replicas are
    taken once)."""
    parts: Dict[tuple, torch.Tensor] = {}
    split = {}
    for shard, tensor in shards:
        parts.setdefault(shard.slot, tensor)
        split[shard.key] = (shard.dim, shard.tp_size)
    experts: Dict[str, Dict[int, torch.Tensor]] = {}
    for key, expert in {slot[:2] for slot in parts}:
        dim, tp_size = split[key]
        experts.setdefault(key, {})[expert] = parts[(key, expert, 0)] if dim is None else torch.cat(
            [parts[(key, expert, r)] for r in range(tp_size)], dim=dim)
    return {key: pieces[None] if None in pieces else
            _stack_experts(pieces, "A" if key.endswith("lora_A.weight") else "B")
            for key, pieces in sorted(experts.items())}


def gather(chunks: List[torch.nn.Module], tensor_of: Callable = None) -> Dict[str, torch.Tensor]:
    """Every adapter tensor of the whole model under its PEFT name, on every rank (`tensor_of`
    picks what: default the weights; e.g. lambda p: p.main_grad). Small: adapters only."""
    mine = [(shard, tensor.cpu().clone()) for shard, tensor in local_shards(chunks, tensor_of)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return assemble(pair for items in everyone for pair in items)


def save(chunks: List[torch.nn.Module], arch: ModelArch, config: LoraConfig, out_dir: str,
         base_model: str = None) -> None:
    """The adapters as a PEFT folder (rank 0 writes). Collective."""
    tensors = gather(chunks)
    if dist.get_rank() == 0:
        write_folder(tensors, arch, config, out_dir, base_model)


def write_folder(tensors: Dict[str, torch.Tensor], arch: ModelArch, config: LoraConfig, out_dir: str,
                 base_model: str = None) -> None:
    """`tensors` (PEFT names, whole) and `config` as a PEFT folder: which modules and ranks as the
    user's folder said them (config.init), else named from the adapted projections (peft_targets)."""
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, WEIGHTS_FILE),
              metadata={"format": "pt"})
    targets = _users_targets(config) or peft_targets(arch, config)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank,
                   "lora_alpha": config.alpha, "lora_dropout": config.dropout,
                   "use_rslora": config.rslora, "bias": "none", **targets,
                   "base_model_name_or_path": base_model, "inference_mode": True}, f, indent=2)


def _users_targets(config: LoraConfig) -> Optional[dict]:
    """TARGET_FIELDS as config.init's folder gives them (None: no folder to read). A run's
    adapters are that folder's (run_config), so its names select the same modules; a folder gone
    since the run began leaves peft_targets' names, which select them too."""
    try:
        with open(os.path.join(config.init, CONFIG_FILE)) as f:
            saved = json.load(f)
    except (TypeError, OSError):
        return None
    return {field: saved.get(field) for field in TARGET_FIELDS}


def peft_targets(arch: ModelArch, config: LoraConfig) -> dict:
    """TARGET_FIELDS for `config`'s adapters on `arch`: a projection by its name (q_proj) where
    that name selects exactly the adapted modules (every linear with it is adapted, for
    target_modules; no other adapted projection has it, for the patterns), else by its path in the
    layer (mlp.shared_experts.up_proj); routed experts' parameters as mlp.experts.NAME."""
    parts = chosen_parts(arch, config)
    modules = part_modules(arch)
    adapted = {(kind, short) for kind, shorts in parts.items() for short in shorts}
    every = {(kind, short) for kind in kinds_of(arch) for short in projections(arch, kind)}

    def path(part) -> str:
        return re.sub(r"^model\.layers\.\d+\.", "", modules[part][0])

    target_modules, target_parameters, ranks, alphas = set(), set(), {}, {}
    for kind, short in sorted(adapted):
        if KINDS[kind].expert:
            target_parameters.add(path((kind, short)))
        else:
            same_name = {(k, s) for k, s in every if s == short and not KINDS[k].expert}
            target_modules.add(short if same_name <= adapted else path((kind, short)))
        key = short if [s for _, s in adapted].count(short) == 1 else re.escape(path((kind, short)))
        if config.rank_of(kind, short) != config.rank:
            ranks[key] = config.rank_of(kind, short)
        if config.alpha_of(kind, short) != config.alpha:
            alphas[key] = config.alpha_of(kind, short)
    return {"target_modules": sorted(target_modules), "target_parameters": sorted(target_parameters) or None,
            "rank_pattern": ranks, "alpha_pattern": alphas}


def run_config(wanted: LoraConfig, arch: ModelArch) -> Optional[LoraConfig]:
    """The adapters a run trains (None: full fine-tuning): actor.lora, or with actor.lora.init the
    PEFT folder's own settings, refused where the two disagree or a target is missing from the
    model. Reads only config files: call before anything is built (planning/resolved.py does)."""
    config = wanted
    if wanted.init:
        config = replace(read_config(wanted.init, arch), init=wanted.init)
        if wanted.rank and (wanted.rank, wanted.alpha, wanted.rslora) != (config.rank, config.alpha,
                                                                           config.rslora):
            raise ValueError(f"actor.lora (rank {wanted.rank}, alpha {wanted.alpha}, rslora "
                             f"{wanted.rslora}) differs from actor.lora.init={wanted.init!r} (rank "
                             f"{config.rank}, alpha {config.alpha}, rslora {config.rslora}); drop "
                             "actor.lora's rank to take the folder's")
    if not config.rank:
        return None
    chosen_parts(arch, config)
    return config


def start(chunks: List[torch.nn.Module], arch: ModelArch, config: Optional[LoraConfig]) -> None:
    """The actor's adapters on its chunks (lora.attach), from config.init if given. Collective."""
    if config is None:
        return
    attach(chunks, arch, config)
    if config.init:
        load(chunks, config.init)
