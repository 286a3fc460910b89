"""Convert a checkpoint between HF and megarl's Megatron format; the first argument is the direction.

  python scripts/convert.py hf-to-megatron --hf-dir IN --out OUT
  python scripts/convert.py megatron-to-hf --megatron-dir IN --out OUT [--experts mxfp4] [--dtype fp8]
  torchrun --nproc-per-node N scripts/convert.py DIRECTION ...

hf-to-megatron  an HF checkpoint (safetensors + config.json) into a Megatron distributed
                checkpoint, which loads at any TP/PP/EP/ETP/CP layout.
megatron-to-hf  a megarl Megatron checkpoint (the converter's, or a run's
                RUN/checkpoints/step_NNNNNN/actor) into sharded safetensors + index, config.json and
                the tokenizer files saved at conversion time; transformers and vLLM load the result.

With N ranks each rank is a pipeline stage and holds only its layers, the first and last stage
fewer when the layer count does not split evenly (ParallelDims.for_conversion; the check scripts
split the same way). OUT must not exist; it appears only once complete. Prints one JSON line; its
`notes` name what was carried as absent (MTP layers config.json declares without their weights).
"""

import argparse
import json

DIRECTIONS = ("hf-to-megatron", "megatron-to-hf")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    directions = parser.add_subparsers(dest="direction", metavar="DIRECTION",
                                       title=f"directions ({' or '.join(DIRECTIONS)})")
    to_megatron = directions.add_parser(
        "hf-to-megatron", help="HF checkpoint -> Megatron distributed checkpoint",
        description="Convert an HF checkpoint (safetensors + config.json) into a megarl Megatron "
                    "distributed checkpoint, loadable at any layout.")
    to_megatron.add_argument("--hf-dir", required=True, help="HF checkpoint directory")
    to_megatron.add_argument("--out", required=True, help="new directory for the Megatron checkpoint")
    to_hf = directions.add_parser(
        "megatron-to-hf", help="megarl Megatron checkpoint -> HF checkpoint",
        description="Convert a megarl Megatron checkpoint into an HF checkpoint (sharded safetensors, "
                    "config.json, the tokenizer files) that transformers and vLLM load.")
    to_hf.add_argument("--megatron-dir", required=True, help="megarl Megatron checkpoint")
    to_hf.add_argument("--out", required=True, help="new directory for the HF checkpoint")
    to_hf.add_argument("--experts", choices=("unquantized", "mxfp4"), default="unquantized",
                       help="routed experts in the model's dtype (default), or as MXFP4 blocks and "
                            "scales as gpt-oss is published (gpt-oss only)")
    to_hf.add_argument("--dtype", choices=("auto", "fp8"), default="auto",
                       help="the weights in the model's dtype (default), or block FP8 as DeepSeek-V3 "
                            "and the Qwen3 -FP8 releases are published: 2-D linear weights as e4m3 "
                            "codes with an fp32 weight_scale_inv per 128x128 block, the rest bf16 "
                            "(not gpt-oss or the hybrids)")
    return parser


def main():
    parser = _parser()
    args = parser.parse_args()
    if args.direction is None:
        parser.error(f"give the direction first: {' or '.join(DIRECTIONS)} "
                     "(e.g. convert.py hf-to-megatron --hf-dir IN --out OUT)")
    # Imported once the arguments are known good: torch and Megatron-Core take seconds to load,
    # and a wrong direction under torchrun or sbatch should fail at once.
    from megarl.models.weights import convert
    from megarl.parallel_state import megatron_groups

    if args.direction == "hf-to-megatron":
        result = convert.hf_to_megatron(args.hf_dir, args.out)
    else:
        result = convert.megatron_to_hf(args.megatron_dir, args.out, args.experts, args.dtype)
    if megatron_groups.is_rank0():
        print(json.dumps(result))
    megatron_groups.destroy()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    main()
