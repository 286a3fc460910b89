"""Convert an HF checkpoint (safetensors + config.json) into a Megatron distributed checkpoint.

  python scripts/convert_hf_to_megatron.py --hf-dir IN --out OUT
  torchrun --nproc-per-node N scripts/convert_hf_to_megatron.py --hf-dir IN --out OUT

With N ranks (at most the model's layer count) each rank holds only its pipeline stage's layers.
The result loads at any TP/PP/EP/ETP/CP layout. Prints one JSON line; its `notes` name what was
carried as absent (MTP layers config.json declares without their weights).
"""

import argparse
import json

from megarl.models.convert import hf_to_megatron
from megarl.parallel_state import megatron_groups


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--hf-dir", required=True, help="HF checkpoint directory")
    parser.add_argument("--out", required=True, help="new directory for the Megatron checkpoint")
    args = parser.parse_args()
    result = hf_to_megatron(args.hf_dir, args.out)
    if megatron_groups.is_rank0():
        print(json.dumps(result))
    megatron_groups.destroy()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    main()
