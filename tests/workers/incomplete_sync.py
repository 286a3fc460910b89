"""Worker: start vLLM on a tiny model, (1) begin an update with a plan whose shape is wrong and
print the refusal, (2) write every engine tensor except the MLP input projections and print the
error the completeness check raises (vLLM itself would accept it silently)."""

import argparse

from megarl.models.hf_config import load_arch
from megarl.resharding.destination import RolloutLayout, vllm_layout
from megarl.rollout.engine import check_update
from megarl.rollout.vllm_engine import VLLMEngine


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    engine = VLLMEngine(args.hf_dir)
    tensors = vllm_layout(load_arch(args.hf_dir), RolloutLayout(1), 1)[0]
    expected = {t.name: t.shape for t in tensors}
    wrong = dict(expected, **{"model.norm.weight": (3,)})
    try:
        engine.begin_weight_update(wrong)
    except ValueError as error:
        print(error)
    engine.begin_weight_update(expected)
    for tensor in tensors:
        if "gate_up_proj" not in tensor.name:
            engine.open_tensors([tensor.name])[tensor.name].zero_()
            engine.close_tensors([tensor.name])
    try:
        check_update(engine.finish_weight_update())
    except RuntimeError as error:
        print(error)
    engine.shutdown()


if __name__ == "__main__":
    main()
