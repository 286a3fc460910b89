"""Routing replay cannot train through experts no one chose: an engine result whose routing has
one uncaptured (-1) row in a MoE layer, matched to its sample as the engine does
(vllm_routing.routing_of) and laid out as the loop does (collect.to_batch), is refused where the
actor sets its routers' targets (router_replay.replay_targets), naming the sample and the layer.
The -1 rows that are no hole pass: dense layers (DeepSeek-V3's first three), each sample's last
token (never fed back) and padding. Routing arrays built here, no engine launched.
"""

import numpy as np
import pytest
import torch

from megarl.actor.packing import pack
from megarl.actor.router_replay import replay_targets
from megarl.models.hf.config import arch_from_hf_config
from megarl.rollout.collect import to_batch
from megarl.rollout.engine import RolloutSample
from megarl.rollout.vllm.routing import routing_of
from tests.published_configs import DEEPSEEK_V3

ARCH = arch_from_hf_config(DEEPSEEK_V3)  # 61 layers, the first 3 dense; top-8 of 256 experts
MOE_LAYERS = [layer for layer in range(ARCH.num_layers) if ARCH.is_moe_layer(layer)]
PROMPTS, RESPONSES = [[1, 2, 3], [6, 7]], [[4, 5], [8, 9, 10, 11]]


def _batch(hole=None):
    """The engine's samples and their batch; `hole` (sample, token, layer) left uncaptured."""
    generator = np.random.default_rng(0)
    samples = []
    for index, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        fed = len(prompt) + len(response) - 1
        experts = np.full((fed, ARCH.num_layers, ARCH.moe_topk), -1, dtype=np.int16)
        for token in range(fed):  # as the capture files them: dense layers keep -1
            experts[token, MOE_LAYERS] = [generator.choice(ARCH.num_experts, ARCH.moe_topk, replace=False)
                                          for _ in MOE_LAYERS]
        if hole is not None and hole[0] == index:
            experts[hole[1], hole[2]] = -1
        found = {tuple(prompt + response[:-1]): experts}
        samples.append(RolloutSample(prompt, response, torch.zeros(len(response)), index,
                                     routed_experts=routing_of(found, prompt, response)))
    batch = to_batch(samples, torch.zeros(len(samples)))
    mb = pack(batch.tokens, batch.lengths, [0, 1], tp=2, cp=1, cp_rank=0)  # tp 2: a padded pack
    return batch, mb


def test_an_uncaptured_moe_row_is_refused_naming_the_sample_and_layer():
    batch, mb = _batch(hole=(1, 2, 40))
    rows = batch.rollout_routing[mb.rows][:, :mb.width]
    for layer in MOE_LAYERS[:MOE_LAYERS.index(40)]:
        replay_targets(rows[:, :, layer], mb, layer, ARCH.moe_topk)
    with pytest.raises(RuntimeError, match=r"sample 1 \(batch row\) at token 2 of its 6, MoE layer 40;"):
        replay_targets(rows[:, :, 40], mb, 40, ARCH.moe_topk)


def test_dense_layers_last_tokens_and_padding_are_no_holes():
    batch, mb = _batch()
    rows = batch.rollout_routing[mb.rows][:, :mb.width]
    assert (rows[:, :, :ARCH.first_dense_layers] == -1).all()  # the engine routes nothing there
    for layer in MOE_LAYERS:
        targets = replay_targets(rows[:, :, layer], mb, layer, ARCH.moe_topk)  # [t, k]
        assert targets.shape == (int(mb.cu_seqlens_padded[-1]), ARCH.moe_topk)
        for row, (start, length) in enumerate(zip(mb.cu_seqlens_padded.tolist(), mb.lengths.tolist())):
            assert torch.equal(targets[start:start + length - 1], rows[row, :length - 1, layer])
            assert torch.equal(targets[start + length - 1], torch.arange(ARCH.moe_topk, dtype=targets.dtype))
        assert torch.equal(targets[-1], torch.arange(ARCH.moe_topk, dtype=targets.dtype))  # tp padding
