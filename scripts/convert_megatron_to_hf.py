"""Convert a megarl Megatron distributed checkpoint back into an HF checkpoint.

  python scripts/convert_megatron_to_hf.py --megatron-dir IN --out OUT
  torchrun --nproc-per-node N scripts/convert_megatron_to_hf.py --megatron-dir IN --out OUT

Writes sharded safetensors + index, config.json and the tokenizer files saved at conversion time;
transformers and vLLM load the result. Prints one JSON line; its `notes` name what was carried as
absent (MTP layers config.json declares without their weights).
"""

import argparse
import json

from megarl.models.convert import megatron_to_hf
from megarl.parallel_state import megatron_groups


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--megatron-dir", required=True, help="megarl Megatron checkpoint")
    parser.add_argument("--out", required=True, help="new directory for the HF checkpoint")
    args = parser.parse_args()
    result = megatron_to_hf(args.megatron_dir, args.out)
    if megatron_groups.is_rank0():
        print(json.dumps(result))
    megatron_groups.destroy()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    main()
