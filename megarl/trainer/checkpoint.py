"""Trainer checkpoints: everything a run needs to continue exactly where it stopped.

Owns the on-disk layout of `run_dir/checkpoints/step_NNNNNN/`:
    actor/, critic/         Megatron distributed checkpoints of the weights (megarl.models.weights.checkpoint:
                            load at any layout, convert to HF with scripts/convert.py megatron-to-hf)
    train_state/rank_R.pt   this rank's optimizer states and main parameters, LR schedules and RNG
                            states (bit-exact resume needs the same layout: checked at load)
    trainer.json            step, layout, model config and prompt-sampler position; written last
A checkpoint is written into `step_NNNNNN.partial` and renamed when every rank has finished, so a
directory named `step_NNNNNN` is always complete; a killed save leaves only a `.partial`, which is
never loaded and is removed by the next save. Does not own when to save (the loop).
"""

import json
import os
import random
import re
import shutil
from dataclasses import asdict
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megarl.models.lora import peft_io
from megarl.models.weights import checkpoint as model_checkpoint
from megarl.planning.resolved import ResolvedRun
from megarl.platform import device_choice

CHECKPOINTS = "checkpoints"
TRAINER_FILE = "trainer.json"
ADAPTERS = "actor_lora"  # the actor's LoRA adapters, a PEFT folder
_NAME = re.compile(r"^step_(\d{6,})$")


def _torch_optimizers(state) -> list:
    """The torch optimizers inside a TrainState's Megatron optimizer (chained or not)."""
    return [o.optimizer for o in getattr(state.optimizer, "chained_optimizers", [state.optimizer])]


def _train_state(state) -> dict:
    # The torch optimizers' parameters are the main (fp32) parameters: views of the model's
    # weights for fp32 models, separate copies for bf16 ones; save them either way.
    return {"optimizers": [o.state_dict() for o in _torch_optimizers(state)],
            "main_params": [[p.detach().cpu() for g in o.param_groups for p in g["params"]]
                            for o in _torch_optimizers(state)],
            "scheduler": state.scheduler.state_dict()}


@torch.no_grad()
def _load_train_state(state, saved: dict) -> None:
    optimizers = _torch_optimizers(state)
    for optimizer, optimizer_state, params in zip(optimizers, saved["optimizers"], saved["main_params"]):
        optimizer.load_state_dict(optimizer_state)
        # load_state_dict keeps torch.load's tensors when dtype and device match, and their
        # storages cannot be resized: the memory handoff (actor/offload.py) could not free them.
        for moments in optimizer.state.values():
            moments.update({k: v.clone() for k, v in moments.items() if isinstance(v, torch.Tensor)})
        for p, value in zip([p for g in optimizer.param_groups for p in g["params"]], params):
            p.copy_(value)
    state.scheduler.load_state_dict(saved["scheduler"])


def _rng_states() -> dict:
    from megatron.core import tensor_parallel

    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if device_choice.on_gpu() else None,
            "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_states(states: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["megatron"])


def _rank_file(path: str) -> str:
    return os.path.join(path, "train_state", f"rank_{dist.get_rank():05d}.pt")


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, CHECKPOINTS, f"step_{step:06d}")


def complete_checkpoints(run_dir: str) -> List[str]:
    """Complete checkpoints of the run, oldest first (partial ones are not listed)."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    found = sorted((int(m.group(1)), name) for name in os.listdir(root)
                   if (m := _NAME.match(name)) and os.path.isfile(os.path.join(root, name, TRAINER_FILE)))
    return [os.path.join(root, name) for _, name in found]


def save(run, step: int, keep: int) -> str:
    """Write the checkpoint of `step` (collective); keep the newest `keep` complete ones."""
    config, resolved = run.config, run.resolved
    final = step_dir(config.run_dir, step)
    partial = final + ".partial"
    rank0 = dist.get_rank() == 0
    if rank0:
        for name in os.listdir(os.path.dirname(final)) if os.path.isdir(os.path.dirname(final)) else ():
            if name.endswith(".partial"):  # left by a save that was killed
                shutil.rmtree(os.path.join(os.path.dirname(final), name))
        os.makedirs(os.path.join(partial, "train_state"))
    dist.barrier()
    model_checkpoint.save(run.actor.state.chunks, os.path.join(partial, "actor"), resolved.hf_config,
                          hf_dir=config.model.hf_dir)
    if resolved.adapters is not None:
        peft_io.save(run.actor.state.chunks, run.arch, resolved.adapters, os.path.join(partial, ADAPTERS),
                     config.model.hf_dir)
    if run.critic is not None:
        model_checkpoint.save(run.critic.state.chunks, os.path.join(partial, "critic"), resolved.hf_config)
    torch.save({"actor": _train_state(run.actor.state),
                "critic": None if run.critic is None else _train_state(run.critic.state),
                "rng": _rng_states()}, _rank_file(partial))
    dist.barrier()
    if rank0:
        with open(os.path.join(partial, TRAINER_FILE), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size(),
                       "layout": asdict(config.layout),
                       "critic": run.critic is not None, "sampler": run.sampler.state_dict()}, f, indent=2)
        os.rename(partial, final)
        for old in complete_checkpoints(config.run_dir)[:-keep]:
            # Renamed before deleting: a kill mid-delete leaves a .partial, not a half-deleted
            # checkpoint that still looks complete.
            os.rename(old, old + ".partial")
            shutil.rmtree(old + ".partial")
    dist.barrier()
    return final


def resolve(run_dir: str, resume: Optional[str]) -> Optional[str]:
    """The checkpoint to resume from: None, 'auto' (the newest complete one, if any) or a path."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    if not os.path.isfile(os.path.join(resume, TRAINER_FILE)):
        raise FileNotFoundError(f"--resume {resume!r} is not a complete megarl checkpoint ({TRAINER_FILE} "
                                f"missing); pass --resume auto or a {CHECKPOINTS}/step_NNNNNN folder")
    return resume


def read_trainer_file(path: str, resolved: ResolvedRun) -> dict:
    """The checkpoint's trainer.json, refused with the difference if this run cannot continue it."""
    config = resolved.config
    with open(os.path.join(path, TRAINER_FILE)) as f:
        saved = json.load(f)
    model_checkpoint.require_model(os.path.join(path, "actor"), resolved.hf_config, config.model.hf_dir)
    for role in ("actor", "critic") if saved["critic"] else ("actor",):
        model_checkpoint.check_files(os.path.join(path, role))
    if saved["layout"] != asdict(config.layout):
        raise ValueError(f"checkpoint {path} was saved at layout {saved['layout']}, this run uses "
                         f"{asdict(config.layout)}; optimizer states resume at the same layout only "
                         "(the actor/ and critic/ weights load at any layout via model.megatron_dir)")
    adapters = os.path.isdir(os.path.join(path, ADAPTERS))
    if adapters != (resolved.adapters is not None):
        raise ValueError(f"checkpoint {path} {'has' if adapters else 'has no'} LoRA adapters ({ADAPTERS}/) "
                         f"but this run {'trains none' if adapters else 'trains some'} (actor.lora); "
                         "resume with the adapters the checkpoint was trained with")
    if saved["critic"] != config.algo.uses_critic:
        raise ValueError(f"checkpoint {path} has critic={saved['critic']} but algo.advantage="
                         f"{config.algo.advantage!r} {'uses' if config.algo.uses_critic else 'has no'} "
                         "critic; resume with the estimator the checkpoint was trained with")
    return saved


def load(run, path: str) -> int:
    """Restore weights, optimizers, schedules, RNG and data position from `path`; returns its step."""
    saved = read_trainer_file(path, run.resolved)
    model_checkpoint.load(run.actor.state.chunks, os.path.join(path, "actor"))
    if run.resolved.adapters is not None:
        peft_io.load(run.actor.state.chunks, os.path.join(path, ADAPTERS))
    if run.critic is not None:
        model_checkpoint.load(run.critic.state.chunks, os.path.join(path, "critic"))
    try:
        state = torch.load(_rank_file(path), weights_only=False)
    except (OSError, RuntimeError, EOFError) as error:  # missing, or truncated ("central directory")
        raise ValueError(f"checkpoint {path}: this rank's training state {_rank_file(path)} is missing or "
                         f"unreadable ({error}); resume from an older checkpoint") from error
    _load_train_state(run.actor.state, state["actor"])
    if run.critic is not None:
        _load_train_state(run.critic.state, state["critic"])
    _set_rng_states(state["rng"])
    run.sampler.load_state_dict(saved["sampler"])
    return saved["step"]
