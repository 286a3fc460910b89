"""What travels to a GPU machine for scripts/gpu_check.sh, against its limit: this checkout's files
(tracked, and untracked but not ignored: what the device tool sends) and the wheel folder
`make gpu-wheels` wrote (carried beside them). Prints the sizes as one JSON line; exits 1 when
their total is over the limit (60 MB: the device tool takes 64 MiB a call).

  python scripts/gpu_travel_size.py .gpu-wheels [--limit-mb 60]

Standard library and git only: it runs before anything is installed.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_MB = 60.0
MB = 1e6


def checkout_bytes(root: str) -> int:
    """Bytes of the files git would hand over: tracked and untracked-not-ignored (a tracked file
    deleted in the work tree sends nothing)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=root, check=True, capture_output=True).stdout.split(b"\0")
    paths = {os.path.join(root, os.fsdecode(name)) for name in names if name}
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p) and not os.path.islink(p))


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def verdict(checkout: int, wheels: int, limit_mb: float) -> dict:
    """Pure: the sizes in MB and whether their total is within `limit_mb`."""
    total = checkout + wheels
    return {"checkout_mb": round(checkout / MB, 2), "wheels_mb": round(wheels / MB, 2),
            "total_mb": round(total / MB, 2), "limit_mb": limit_mb, "fits": total <= limit_mb * MB}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("wheels", help="the wheel folder (make gpu-wheels: .gpu-wheels)")
    parser.add_argument("--limit-mb", type=float, default=LIMIT_MB)
    args = parser.parse_args()
    if not os.path.isdir(args.wheels):
        sys.exit(f"{args.wheels}: no such folder: run `make gpu-wheels` first")
    result = verdict(checkout_bytes(ROOT), folder_bytes(args.wheels), args.limit_mb)
    print(json.dumps(result))
    if not result["fits"]:
        sys.exit(f"the checkout ({result['checkout_mb']} MB) and {args.wheels} ({result['wheels_mb']} MB) "
                 f"make {result['total_mb']} MB, over {args.limit_mb} MB: drop the largest wheels, or "
                 "untracked files that are not ignored")


if __name__ == "__main__":
    main()
