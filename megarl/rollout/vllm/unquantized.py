"""An engine for a checkpoint published quantized (gpt-oss's MXFP4 experts, block FP8) that the
trainer holds unquantized: vLLM builds the model unquantized, in the run's dtype, so the parameters
the sync writes are the trainer's own (megarl.models.weights.destination plans those shapes; an
MXFP4 or FP8 engine's codes and scales would be refused at the first sync as parameters it does not
plan). Only where the weights come from the sync (load_format "dummy"): vLLM's loader cannot read
the quantized tensors into unquantized layers. Does not own dequantizing a checkpoint
(models/hf/fused_experts.py, models/hf/fp8_reader.py).
"""

from megarl.models.hf.config import load_hf_config


def engine_kwargs(hf_dir: str, load_format: str) -> dict:
    quant = load_hf_config(hf_dir).get("quantization_config") or {}
    if quant.get("quant_method") not in ("mxfp4", "fp8") or load_format != "dummy":
        return {}
    return dict(hf_overrides={"quantization_config": None})
