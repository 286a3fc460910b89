"""Compare two HF safetensors checkpoints tensor by tensor: names, shapes, dtypes and values.

  python scripts/compare_hf_checkpoints.py A B

Prints one JSON line; exits 1 unless the two are bit-exact.
"""

import argparse
import json
import sys

from megarl.models.hf.safetensors_reader import SafetensorsReader


def compare(a_dir: str, b_dir: str) -> dict:
    """The JSON line's fields: tensor count of A, names only in A or only in B, names whose dtype,
    shape or values differ, and bit_exact."""
    a, b = SafetensorsReader(a_dir), SafetensorsReader(b_dir)
    names_a, names_b = set(a.names()), set(b.names())
    differing = sorted(
        name for name in names_a & names_b
        if a(name).dtype != b(name).dtype or a(name).shape != b(name).shape
        or not a(name).equal(b(name))
    )
    result = {"tensors": len(names_a), "only_in_a": sorted(names_a - names_b),
              "only_in_b": sorted(names_b - names_a), "differing": differing}
    result["bit_exact"] = not (result["only_in_a"] or result["only_in_b"] or differing)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    args = parser.parse_args()
    result = compare(args.a, args.b)
    print(json.dumps(result))
    sys.exit(0 if result["bit_exact"] else 1)


if __name__ == "__main__":
    main()
