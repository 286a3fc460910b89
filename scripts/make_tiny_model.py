"""Write a tiny random HF checkpoint of a supported family (or a named variant) to --out.

  python scripts/make_tiny_model.py --model qwen3_moe --out runs/tiny/qwen3_moe
  python scripts/make_tiny_model.py --model deepseek_v3 --layers 3 --out runs/tiny/deepseek_v3_3
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
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers {args.layers}: give at least 1")
    print(make_named(args.model, args.out, args.seed, num_hidden_layers=args.layers))


if __name__ == "__main__":
    main()
