"""LoRA adapters in PEFT's folder format, in and out of megarl's Megatron models.

A PEFT LoRA folder holds adapter_config.json (r, lora_alpha, target_modules, ...) and
adapter_model.safetensors with one lora_A [r, in] and one lora_B [out, r] per HF module, named
`base_model.model.<HF module>.lora_A.weight`. megarl's adapters (models/lora/adapters.py) hold the same
matrices, cut for the layout, so loading cuts and saving joins: no arithmetic, and PEFT -> megarl
-> PEFT is bit-exact.
"""

import json
import os
import re
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional

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
    chosen_kinds,
    hf_module_names,
    kinds_of,
)

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


def read_config(adapter_dir: str, arch: ModelArch) -> LoraConfig:
    """The LoraConfig a PEFT folder was trained with; refuses what megarl's adapters cannot hold."""
    path = os.path.join(adapter_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{adapter_dir!r} is not a PEFT adapter folder: {CONFIG_FILE} is "
                                "missing (PEFT's save_pretrained writes it)")
    with open(path) as f:
        saved = json.load(f)
    if saved.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {saved.get('peft_type')!r}; megarl loads LORA adapters")
    for field, plain in (("use_dora", False), ("bias", "none"), ("modules_to_save", None)):
        if saved.get(field, plain) not in (plain, None, {}, []):
            raise ValueError(f"{path}: {field}={saved[field]!r} is not supported; megarl's adapters are "
                             f"plain LoRA ({field}={plain!r})")
    rank, alpha = int(saved["r"]), float(saved["lora_alpha"])
    found = _file_kinds(adapter_dir, arch, saved.get("target_parameters") or [])
    alphas = {kind: _pattern_value(module, saved.get("alpha_pattern") or {}, alpha)
              for kind, (module, _) in found.items()}
    return LoraConfig(rank=rank, alpha=alpha, dropout=float(saved.get("lora_dropout", 0.0)),
                      targets=tuple(found), rslora=bool(saved.get("use_rslora", False)),
                      kind_ranks={kind: r for kind, (_, r) in found.items() if r != rank},
                      kind_alphas={kind: a for kind, a in alphas.items() if a != alpha})


def _pattern_value(module: str, patterns: Dict[str, float], default: float) -> float:
    """PEFT's *_pattern lookup: the first key that matches the end of the module's name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(value)
    return default


def _file_kinds(adapter_dir: str, arch: ModelArch, target_parameters: List[str]) -> Dict[str, tuple]:
    """{kind: (an HF module it adapts, its rank)} of every kind the folder's tensors adapt, read from
    the tensors themselves (target_modules may be a regex; PEFT widens some ranks)."""
    present = kinds_of(arch)
    adapted = {name.rsplit(".", 1)[-1] for name in target_parameters}
    routed = [kind for kind in EXPERT_ORDER if kind in present and KINDS[kind].expert in adapted]
    found, seen = {}, set()  # seen: the HF projections (last name part) the tensors adapt
    with safe_open(os.path.join(adapter_dir, WEIGHTS_FILE), "pt") as f:
        for key in f.keys():
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
            else:
                short = module.rsplit(".", 1)[-1]
                kind = next((k for k in present if not KINDS[k].expert and short in hf_module_names(arch, k)
                             and (".shared_experts." in key) == k.startswith("shared")), None)
            if kind is None:
                raise ValueError(f"{adapter_dir}: {key} adapts a module megarl has no adapter kind for "
                                 f"on {arch.family} (kinds: {present})")
            found[kind] = (module, rows)
            seen.add(module.rsplit(".", 1)[-1])
    if not found:
        raise ValueError(f"{adapter_dir}: {WEIGHTS_FILE} holds no lora_A tensors")
    for kind in found:  # a fused Megatron linear holds all its projections' adapters or none
        missing = sorted(hf_module_names(arch, kind) - seen)
        if missing:
            raise ValueError(f"{adapter_dir} adapts {sorted(hf_module_names(arch, kind) & seen)} but "
                             f"not {missing}: megarl fuses them into one linear ({kind}) and adapts "
                             f"all of its projections; train the folder with {missing} among "
                             "target_modules too")
    return found


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
                                     f"adapter needs rank {adapter.rank} (lora.rank)")
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
    """`tensors` (PEFT names, whole) and `config` as a PEFT folder."""
    kinds = chosen_kinds(arch, config)
    modules = sorted({n for kind in kinds if not KINDS[kind].expert for n in hf_module_names(arch, kind)})
    parameters = sorted({f"mlp.experts.{KINDS[kind].expert}" for kind in kinds if KINDS[kind].expert})
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, WEIGHTS_FILE),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank,
                   "lora_alpha": config.alpha, "lora_dropout": config.dropout,
                   "use_rslora": config.rslora, "target_modules": modules,
                   "target_parameters": parameters or None, "bias": "none",
                   "rank_pattern": _patterns(arch, config.kind_ranks),
                   "alpha_pattern": _patterns(arch, config.kind_alphas),
                   "base_model_name_or_path": base_model, "inference_mode": True}, f, indent=2)


def _patterns(arch: ModelArch, by_kind: Dict[str, float]) -> Dict[str, float]:
    """PEFT's rank_pattern or alpha_pattern for the kinds whose rank or alpha is their own (as PEFT
    writes them: ".*\\.NAME"; the shared experts' first, as _pattern_value takes the first match)."""
    patterns = {}
    for kind in sorted(by_kind, key=lambda k: not k.startswith("shared")):
        names = [KINDS[kind].expert] if KINDS[kind].expert else sorted(hf_module_names(arch, kind))
        prefix = r".*\.shared_experts\." if kind.startswith("shared") else r".*\."
        patterns.update({prefix + re.escape(name): by_kind[kind] for name in names})
    return patterns


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
    chosen_kinds(arch, config)
    return config


def start(chunks: List[torch.nn.Module], arch: ModelArch, config: Optional[LoraConfig]) -> None:
    """The actor's adapters on its chunks (lora.attach), from config.init if given. Collective."""
    if config is None:
        return
    attach(chunks, arch, config)
    if config.init:
        load(chunks, config.init)
