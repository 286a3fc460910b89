"""The weight sync's measured device constants, one row per GPU kind, and which row a plan uses.

Owns the table (KINDS): what `bench/bench_sync_copies.py --device cuda` measured against megarl's
transport on each GPU kind lent to this project (docs/gpu/sync_copies.json keeps each run's
figures and where they come from), and the choice of a kind: a flag (`--gpu h100|h200`) wins,
else the visible GPU's name, else H100 when no GPU is visible (a login node: the kind the
published figures in docs/PERFORMANCE.md use), said as such. A GPU of no measured kind is refused.
Does not own the cost model (cluster_plan.Links, round_phases) nor the link speeds, NVLink and
InfiniBand, which are nominal figures assumed for every kind, not measured.
"""

import re
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class GpuKind:
    name: str          # the --gpu value
    device: str        # torch.cuda.get_device_name() of the GPU measured
    copy_us: float     # a batched Copy of 393 KB slabs: its views + its share of the round's
                       # torch._foreach_copy_ (`batched_us_per_copy`)
    pack_gbps: float   # packing a send buffer, torch.cat of those slabs (`pack_GBps`)
    hbm_gbps: float    # a plain warm 1 GiB copy_ (`plain_copy_GBps`): local copies, unpacking
    measured: str      # when, and where the figures are kept

    def describe(self) -> str:
        return (f"{self.name}: a Copy {self.copy_us:g} us, packing {self.pack_gbps:g} GB/s, copies "
                f"{self.hbm_gbps:g} GB/s (measured on {self.device}, {self.measured})")


KINDS = {
    "h100": GpuKind("h100", "NVIDIA H100 80GB HBM3", copy_us=7.3, pack_gbps=222.0, hbm_gbps=1482.0,
                    measured="2026-11-26, DESIGN.md turn 3; docs/gpu/sync_copies.json"),
    "h200": GpuKind("h200", "NVIDIA H200", copy_us=11.7, pack_gbps=95.0, hbm_gbps=2086.0,
                    measured="2026-11-28, gpu_check.json's sync_copies step; docs/gpu/sync_copies.json"),
}
DEFAULT = "h100"  # when no GPU is visible and no flag says
_FLAG = "--gpu " + "|".join(KINDS)


def kind_of_device(device: str) -> GpuKind:
    """The kind whose name is a word of `device` ('NVIDIA H100 80GB HBM3' -> h100; 'NVIDIA GH200
    480GB' is no H200: another package, not measured)."""
    for kind in KINDS.values():
        if re.search(rf"\b{kind.name}\b", device, re.IGNORECASE):
            return kind
    raise ValueError(f"GPU {device!r} has no measured sync constants (kinds: {', '.join(KINDS)}): pass "
                     f"{_FLAG} to plan with one of them, or measure it with "
                     "bench/bench_sync_copies.py --device cuda and add it to megarl/resharding/gpu_kinds.py")


def choose(flag: Optional[str], device: Optional[str]) -> Tuple[GpuKind, str]:
    """(the kind, how it was chosen) from --gpu's value (None: not given) and the visible GPU's
    name (None: no GPU). The flag wins."""
    if flag is not None:
        if flag.lower() not in KINDS:
            raise ValueError(f"--gpu {flag!r}: no such kind; expected one of {', '.join(KINDS)}")
        return KINDS[flag.lower()], f"--gpu {flag.lower()}"
    if device is not None:
        return kind_of_device(device), f"the visible GPU, {device}"
    return KINDS[DEFAULT], f"the default: no GPU visible ({_FLAG} chooses)"


def visible_device() -> Optional[str]:
    """The name of the GPU torch would use, or None where there is none."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None
