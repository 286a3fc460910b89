"""Write a tiny random HF checkpoint of a supported family (or a named variant) to --out.

  python scripts/make_tiny_model.py --model qwen3_moe --out runs/tiny/qwen3_moe
"""

import argparse

from megarl.demo.tiny_checkpoint import FAMILIES, VARIANTS, make_named


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(FAMILIES) + sorted(VARIANTS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_named(args.model, args.out, args.seed))


if __name__ == "__main__":
    main()
