"""vllm_cpu_fixes.eager_helpers: vLLM's torch.compile'd helpers run eagerly on CPU, with the
results of their plain definition."""

import pytest
import torch


@pytest.fixture
def eager():
    from megarl.rollout.vllm import cpu_fixes as vllm_cpu_fixes
    vllm_cpu_fixes.eager_helpers()
    yield
    torch.compiler.set_stance("default")


def test_compiled_helpers_run_eagerly_and_count_as_defined(eager):
    from torch._dynamo.utils import counters
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    generator = torch.Generator().manual_seed(0)
    frames = counters["stats"]["unique_graphs"]
    for rows in (3, 5, 8):  # new shapes: each would be a recompile
        x = torch.randn(rows, 48, generator=generator)
        values = x[:, :1] + torch.randn(rows, 1, generator=generator) * 0.1
        assert batched_count_greater_than(x, values).tolist() == [
            sum(float(v) >= float(row_values[0]) for v in row) for row, row_values in zip(x, values)]
    assert counters["stats"]["unique_graphs"] == frames  # no graph was captured
