"""Moving one bucket's copies: point-to-point between the ranks that hold and need them.

A large slab of rows goes as its own message straight from the source parameter into the
destination tensor (no copy on either side, `Copy.direct`); the rest a rank sends to one peer is
packed into one flat buffer per dtype. All messages of a round are posted at once over the
sync's Links (the training world, or the trainer-rollout bridge: parallel_state/links.py).
Copies whose source and destination are the same rank, and unpacking, are written as one
batched copy per round (torch._foreach_copy_), not one call per slab. Each rank runs only its
own share of the plan (Plan.rank_work). Memory in flight: this rank's buffers of one round
(plan.py keeps them within the bucket size). What moves is counted here, message by message as
it is posted (Traffic), not read back from the plan: the sync reports these counts, and the tests
hold them against the planner's (tests/test_plan_sync.py).
A sender-quantized copy (Copy.fp8: into a block-FP8 engine tensor, resharding/plan.py) is
quantized from its source slab here on the sender (models/hf/fp8_blocks.py, the quantizer the
engine uses) and travels packed as bytes, all its peer's scales of the round first (fp32, kept
4-byte aligned) then their codes; the receiver writes them into the tensor's codes and scales.
Every destination tensor must be on the Links' device, as this module's buffers are: NCCL
receives only into tensors on its GPU, while gloo takes a CPU tensor as well, so a destination
elsewhere would pass every CPU test and crash on a GPU. It is refused before anything is posted.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

from megarl.models.hf import fp8_blocks
from megarl.models.hf.config import DTYPES
from megarl.models.weights import fp8_layout
from megarl.parallel_state.links import Links, Transfer
from megarl.resharding.plan import FP8_WIRE, Copy

# Copy.wire -> torch.dtype
TORCH_DTYPES = {**{str(dtype): dtype for dtype in DTYPES.values()}, FP8_WIRE: torch.uint8}


def _source(copy: Copy, local: Dict[Tuple[str, int], torch.Tensor]) -> torch.Tensor:
    return local[(copy.canonical, copy.tp_rank)].narrow(copy.dim, copy.src_start, copy.length)


def _target(copy: Copy, targets: Dict[str, torch.Tensor]) -> torch.Tensor:
    tensor = targets[copy.tensor]
    if copy.expert is not None:
        tensor = tensor[copy.expert]
    if copy.dst_step == 1:
        return tensor.narrow(copy.dim, copy.dst_start, copy.length)
    rows = tensor.narrow(copy.dim, copy.dst_start, (copy.length - 1) * copy.dst_step + 1)
    return rows[(slice(None),) * copy.dim + (slice(None, None, copy.dst_step),)]


def _scale_target(copy: Copy, targets: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The scales of a sender-quantized copy's blocks in its tensor's weight_scale_inv."""
    scale = targets[fp8_blocks.scale_name(copy.tensor)]
    if copy.expert is not None:
        scale = scale[copy.expert]
    return scale.narrow(copy.dim, *fp8_layout.slab_scales(copy.dim, copy.dst_start, copy.length))


def _quantized(copy: Copy, local: Dict[Tuple[str, int], torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes as bytes, scales) of a sender-quantized copy's source slab."""
    codes, scales = fp8_blocks.quantize(_source(copy, local), fp8_blocks.BLOCK)
    return codes.view(torch.uint8), scales


def _pack_fp8(copies: List[Copy], local: Dict[Tuple[str, int], torch.Tensor], device) -> torch.Tensor:
    """One peer's sender-quantized copies of a round as one byte buffer: every copy's scales, then
    every copy's codes (the scales' offsets stay multiples of 4, as viewing them as fp32 needs)."""
    flat = torch.empty(sum(c.nbytes for c in copies), dtype=torch.uint8, device=device)
    scales, codes = _fp8_parts(copies, flat)
    for copy, scale_bytes, code_bytes in zip(copies, scales, codes):
        quantized_codes, quantized_scales = _quantized(copy, local)
        code_bytes.copy_(quantized_codes.reshape(-1))
        scale_bytes.copy_(quantized_scales.view(torch.uint8).reshape(-1))
    return flat


def _fp8_parts(copies: List[Copy], flat: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The scale bytes and code bytes of each copy in a buffer _pack_fp8 laid out."""
    parts = flat.split([c.nbytes - c.numel for c in copies] + [c.numel for c in copies])
    return list(parts[:len(copies)]), list(parts[len(copies):])


@dataclass
class Traffic:
    """What this rank's transport moved: bytes per (peer, dtype) each way and messages each way,
    added up per message as the messages are posted (a message's bytes are its tensor's, so a
    duplicate or oversized message shows), and the bytes it copied between its own tensors
    (counted per local copy: those are no messages)."""
    sent: Dict[Tuple[int, str], int] = field(default_factory=dict)      # (peer, dtype) -> bytes
    received: Dict[Tuple[int, str], int] = field(default_factory=dict)  # (peer, dtype) -> bytes
    messages_sent: int = 0
    messages_received: int = 0
    local_bytes: int = 0

    def post(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        for counts, transfers in ((self.sent, sends), (self.received, recvs)):
            for tensor, peer in transfers:
                key = (peer, str(tensor.dtype))
                counts[key] = counts.get(key, 0) + tensor.numel() * tensor.element_size()
        self.messages_sent += len(sends)
        self.messages_received += len(recvs)


def exchange(rounds: Tuple[Tuple[Copy, ...], ...], links: Links, local: Dict[Tuple[str, int], torch.Tensor],
             targets: Dict[str, torch.Tensor], traffic: Traffic) -> int:
    """Fill this rank's `targets` with its copies of one bucket (`Plan.rank_work(rank)[bucket]`),
    round by round, adding what it moves to `traffic`; returns the most bytes of buffers
    allocated at once."""
    _require_links_device(targets, links)
    peak = 0
    for copies in rounds:
        peak = max(peak, _exchange_round(copies, links, local, targets, traffic))
    return peak


def _require_links_device(targets: Dict[str, torch.Tensor], links: Links) -> None:
    """Every target on `links.device`: what is received goes there straight (a direct slab) or
    through a buffer of ours (packed, or cast), and the buffers are allocated there."""
    for name, tensor in targets.items():
        if tensor.device != links.device:
            raise RuntimeError(
                f"weight sync: destination tensor {name} is on {tensor.device}, but the sync's links "
                f"({links.name}) move tensors on {links.device} (NCCL cannot receive into it): the "
                f"destination must open its tensors on {links.device} and copy them elsewhere when "
                f"they are closed, as the HF export does (resharding/hf_export.py)")


def _copy_all(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every (target, source) at once: one batched kernel where the slabs allow it (GPU)."""
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [s for _, s in pairs])


def _exchange_round(round_copies: Tuple[Copy, ...], links: Links,
                    local: Dict[Tuple[str, int], torch.Tensor],
                    targets: Dict[str, torch.Tensor], traffic: Traffic) -> int:
    """One round: returns the bytes of the buffers it allocated."""
    rank, device = links.rank, links.device
    local_bytes = 0
    sends: Dict[Tuple[int, str], List[Copy]] = {}
    recvs: Dict[Tuple[int, str], List[Copy]] = {}
    outgoing, incoming, received, staged, writes = [], [], [], [], []
    for copy in round_copies:
        if copy.src == rank == copy.dst and copy.fp8:
            codes, scales = _quantized(copy, local)
            writes += [(_target(copy, targets).view(torch.uint8), codes),
                       (_scale_target(copy, targets), scales)]
            local_bytes += codes.numel() + scales.numel() * scales.element_size()
        elif copy.src == rank == copy.dst:
            source = _source(copy, local)
            writes.append((_target(copy, targets), source))
            local_bytes += source.numel() * source.element_size()
        elif copy.src == rank and copy.direct:
            outgoing.append((_source(copy, local), copy.dst))
        elif copy.dst == rank and copy.direct:
            target = _target(copy, targets)
            if target.dtype != TORCH_DTYPES[copy.dtype]:  # the engine casts: receive, then copy
                staged.append((target, torch.empty(target.shape, dtype=TORCH_DTYPES[copy.dtype],
                                                   device=device)))
                target = staged[-1][1]
            incoming.append((target, copy.src))
        elif copy.src == rank:
            sends.setdefault((copy.dst, copy.wire), []).append(copy)
        elif copy.dst == rank:
            recvs.setdefault((copy.src, copy.wire), []).append(copy)
    _copy_all(writes)
    traffic.local_bytes += local_bytes
    if not outgoing and not incoming and not sends and not recvs:
        return 0
    allocated = sum(buffer.numel() * buffer.element_size() for _, buffer in staged)
    for (peer, wire), copies in sends.items():
        flat = (_pack_fp8(copies, local, device) if wire == FP8_WIRE
                else torch.cat([_source(c, local).reshape(-1) for c in copies]))
        outgoing.append((flat, peer))
        allocated += flat.numel() * flat.element_size()
    for (peer, wire), copies in recvs.items():
        flat = torch.empty(sum(c.nbytes for c in copies) // TORCH_DTYPES[wire].itemsize,
                           dtype=TORCH_DTYPES[wire], device=device)
        incoming.append((flat, peer))
        received.append((wire, copies, flat))
        allocated += flat.numel() * flat.element_size()
    traffic.post(outgoing, incoming)
    links.exchange(outgoing, incoming)
    writes = list(staged)
    for wire, copies, flat in received:
        if wire == FP8_WIRE:
            for copy, scale_bytes, code_bytes in zip(copies, *_fp8_parts(copies, flat)):
                codes, scales = _target(copy, targets).view(torch.uint8), _scale_target(copy, targets)
                writes += [(codes, code_bytes.view(codes.shape)),
                           (scales, scale_bytes.view(torch.float32).view(scales.shape))]
            continue
        for copy, part in zip(copies, flat.split([c.numel for c in copies])):
            target = _target(copy, targets)
            writes.append((target, part.view(target.shape)))
    _copy_all(writes)
    return allocated
