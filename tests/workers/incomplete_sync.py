"""Worker: start vLLM on a tiny model, send every weight except the MLP input projections,
and print the error the completeness check raises (vLLM itself would accept it silently)."""

import argparse

from megarl.models.hf_io import SafetensorsReader
from megarl.rollout.engine import check_update
from megarl.rollout.vllm_engine import VLLMEngine


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    args = parser.parse_args()
    engine = VLLMEngine(args.hf_dir)
    reader = SafetensorsReader(args.hf_dir)
    engine.begin_weight_update()
    engine.load_weights((name, reader(name)) for name in reader.names()
                        if "gate_proj" not in name and "up_proj" not in name)
    try:
        check_update(engine.finish_weight_update())
    except RuntimeError as error:
        print(error)
    engine.shutdown()


if __name__ == "__main__":
    main()
