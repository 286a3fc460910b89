"""The HF export over NCCL: every receive lands in a tensor on the sync's Links' device, and the
writer copies it to the host itself. On the CPU the links' device is the CPU, where a misplaced
destination would pass unseen (gloo receives into any CPU tensor), so the refusal is tested with
a destination on the meta device, and a real export records each receive's device."""

import os

import pytest
import torch
from safetensors.torch import load_file

from megarl.resharding import transport
from megarl.resharding.hf_export import HFDirectoryWriter
from megarl.resharding.plan import Copy
from tests.launch import last_json, load_script, run

GATE = "model.layers.0.mlp.gate_proj.weight"


class RecordingLinks:
    """Rank 0 of `size` on `device`: every receive it is asked to post is recorded and filled with ones."""
    name, rank = "recording", 0

    def __init__(self, device: str, size: int = 2):
        self.device, self.size, self.posted = torch.device(device), size, []

    def exchange(self, sends, recvs):
        self.posted += recvs
        for tensor, _ in recvs:
            tensor.fill_(1.0)


def _from_rank1(rows: int) -> Copy:
    """`rows` rows of a [256, 256] fp32 tensor from rank 1 into rank 0's GATE."""
    return Copy(src=1, dst=0, canonical="decoder.layers.0.mlp.linear_fc1.weight", tp_rank=0, dim=0,
                src_start=0, length=rows, tensor=GATE, expert=None, dst_start=0, numel=rows * 256,
                dtype=str(torch.float32))


@pytest.mark.parametrize("rows,direct", [(256, True), (4, False)])
def test_receives_go_only_into_tensors_on_the_links_device(rows, direct):
    copy = _from_rank1(rows)
    assert copy.direct == direct  # 256 KiB of rows goes as its own message, 4 KiB packed
    links = RecordingLinks("cpu")
    with pytest.raises(RuntimeError) as refused:
        transport.exchange(((copy,),), links, {}, {GATE: torch.empty(256, 256, device="meta")},
                           transport.Traffic())
    assert all(part in str(refused.value) for part in (GATE, "is on meta", "move tensors on cpu",
                                                       "open its tensors on cpu"))
    assert links.posted == []  # refused before anything was posted

    target = torch.zeros(256, 256)
    transport.exchange(((copy,),), links, {}, {GATE: target}, transport.Traffic())
    assert [tensor.device for tensor, _ in links.posted] == [links.device]
    # a direct slab is received straight into the destination; a packed one through a buffer
    assert (links.posted[0][0].untyped_storage().data_ptr() == target.untyped_storage().data_ptr()) == direct
    assert target[:rows].eq(1).all() and target[rows:].eq(0).all()


def test_writer_opens_on_the_links_device_and_writes_host_copies(tmp_path):
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"  # kept in fp32 in HF checkpoints
    shapes = {GATE: (4, 3), bias: (8,)}

    def writer(device: str) -> HFDirectoryWriter:
        made = HFDirectoryWriter(str(tmp_path / device), {}, str(tmp_path), torch.bfloat16, None, print,
                                 RecordingLinks(device, size=1))
        made.begin_weight_update(shapes)
        return made

    opened = writer("meta").open_tensors(list(shapes))
    assert {name: (t.device.type, t.dtype) for name, t in opened.items()} == {
        GATE: ("meta", torch.bfloat16), bias: ("meta", torch.float32)}

    on_cpu = writer("cpu")
    for i, tensor in enumerate(on_cpu.open_tensors(list(shapes)).values()):
        tensor.fill_(i + 1)
    on_cpu.close_tensors(list(shapes))
    assert on_cpu.open == {}  # the bucket's tensors are let go once written
    written = load_file(os.path.join(on_cpu.partial, on_cpu.weight_map[GATE]))
    assert written[GATE].eq(1).all() and written[bias].eq(2).all() and written[bias].dtype == torch.float32


def test_a_live_export_with_direct_slabs_receives_only_on_the_links_device(hf_models, tmp_path):
    """Two pipeline stages: the second stage's 256 KiB projections reach rank 0 as direct messages."""
    out = tmp_path / "hf"
    result = last_json(run("tests/workers/export_receives.py", "--hf-dir", hf_models["qwen3"],
                           "--out", str(out), nproc=2))
    receives = result["receives"]
    assert any(into_writer for _, _, into_writer in receives), result
    assert {device for device, _, _ in receives} == {result["links_device"]}, result
    compared = load_script("compare_hf_checkpoints").compare(hf_models["qwen3"], str(out))
    assert compared["bit_exact"], compared
