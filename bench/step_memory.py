"""The optimizer step's transient memory, measured on the CPU against what the memory plan counts
(megarl/actor/optimizer.py: step_transient_bytes), one part of the step at a time.

  python bench/step_memory.py [--elements N]

Cases (each the resident set's high-water mark above what was resident when it began, the second
of two calls; each tensor 10M fp32 elements, so that glibc maps it on its own and returns it when
freed: smaller ones come from its heap, whose freed memory a later tensor reuses unseen):
  finite_isfinite   torch.isfinite(g).all() on a gradient buffer: megarl's check before the step
                    at 2c0aa45, what the H200's update peaks held (docs/gpu/h200_2026-11-28.json)
  finite_aminmax    torch.aminmax(g), megarl's check now
  adam_foreach      torch.optim.AdamW(foreach=True): what Megatron builds without Transformer Engine
                    or Apex runs on CUDA (multi-tensor)
  adam_per_tensor   torch.optim.AdamW with neither set: what the same build runs on the CPU
  adam_fused        torch.optim.AdamW(fused=True): the offload's HybridDeviceOptimizer's parts
  clip_local        Megatron's local_multi_tensor_scale (clip_grad without TE or Apex)
Prints one JSON object per case: measured and planned bytes, their ratio, and per element.
"""

import argparse
import json

import torch
from megatron.core.utils import local_multi_tensor_scale

from megarl.actor.optimizer import NO_OFFLOAD, OptimizerOffloadConfig, step_transients
from megarl.planning import memory_record
from megarl.platform import device_memory


def _extra(fn) -> int:
    """Bytes the call's resident high-water mark rose above its start (the second of two calls)."""
    fn()
    with device_memory.measured() as memory:
        fn()
    return memory.extra_bytes


def _adam(sizes, **kwargs):
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    return torch.optim.AdamW(params, lr=1e-3, **kwargs)


def _finite(elements: int, then: float, now: float) -> dict:
    """The check before the step on one fp32 gradient buffer: 2c0aa45's and today's."""
    grads = torch.randn(elements)
    return {"finite_isfinite": (_extra(lambda: bool(torch.isfinite(grads).all())), then),
            "finite_aminmax": (_extra(lambda: bool(torch.isfinite(torch.stack(torch.aminmax(grads))).all())),
                               now)}


def cases(n: int) -> dict:
    """{case: (measured, planned) bytes}. Four parameter tensors of n elements: each follows one
    as large, where the per-tensor step's bound (3 of the largest) is reached."""
    sizes, largest = (n, n, n, n), n
    total = sum(sizes)

    def planned(part, adam="torch", on_gpu=False, offload=NO_OFFLOAD, clip=False):
        return step_transients(adam, on_gpu, offload, total, largest, clip)[part]

    then = memory_record.load()["then"]["finite_check_bytes_per_gradient_element"]
    out = _finite(total, then * total, planned("finite"))
    for case, kwargs, on_gpu, offload in (
            ("adam_foreach", dict(foreach=True), True, NO_OFFLOAD),  # what CUDA runs
            ("adam_per_tensor", {}, False, NO_OFFLOAD),
            ("adam_fused", dict(fused=True), False, OptimizerOffloadConfig(fraction=0.5))):
        optimizer = _adam(sizes, **kwargs)
        out[case] = (_extra(optimizer.step), planned("adam", on_gpu=on_gpu, offload=offload))
        del optimizer
    tensors = [torch.randn(size) for size in sizes]
    out["clip_local"] = (_extra(lambda: local_multi_tensor_scale(0, None, [tensors, tensors], 0.5)),
                         planned("clip", clip=True))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--elements", type=int, default=10_000_000,
                        help="the largest tensor's elements (>= 8.4M: glibc maps each tensor on its own)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for case, (measured, planned) in cases(args.elements).items():
        print(json.dumps({"case": case, "measured_bytes": measured, "planned_bytes": int(planned),
                          "measured_over_planned": round(measured / planned, 4) if planned else None,
                          "largest_elements": args.elements}), flush=True)


if __name__ == "__main__":
    main()
