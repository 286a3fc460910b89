"""Write a tiny random HF checkpoint of a supported family (or a named variant) to --out.

  python scripts/make_tiny_model.py --model qwen3_moe --out runs/tiny/qwen3_moe
  python scripts/make_tiny_model.py --model deepseek_v3 --layers 3 --out runs/tiny/deepseek_v3_3
  python scripts/make_tiny_model.py --model deepseek_v3 --fp8 --out runs/tiny/deepseek_v3_fp8

--fp8 writes the checkpoint as the block-FP8 releases are published (DeepSeek-V3/R1, Qwen3 -FP8):
float8_e4m3fn weights with fp32 weight_scale_inv per 128x128 block, embeddings, norms, routers
and the LM head in the model's dtype (bfloat16), three shards with an index.
"""

import argparse

from megarl.demo.tiny_checkpoint import BASE, FAMILIES, VARIANTS, make_named


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(FAMILIES) + sorted(VARIANTS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=BASE["num_hidden_layers"],
                        help="decoder layers (default %(default)s); an odd count has no even split over "
                             "two pipeline stages")
    parser.add_argument("--fp8", action="store_true", help="block-FP8 weights as published (not gpt-oss)")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers {args.layers}: give at least 1")
    if args.fp8 and args.model.startswith("gpt_oss"):
        parser.error("--fp8: gpt-oss is published with MXFP4 experts (--model gpt_oss_mxfp4), not block FP8")
    fp8 = dict(fp8=True, dtype="bfloat16") if args.fp8 else {}
    print(make_named(args.model, args.out, args.seed, num_hidden_layers=args.layers, **fp8))


if __name__ == "__main__":
    main()
