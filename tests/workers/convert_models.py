"""torchrun worker: the converter scripts' own conversions (scripts/convert_hf_to_megatron.py,
scripts/convert_megatron_to_hf.py) for several checkpoints in one launch: starting a launch costs
more here than converting a tiny model. Each job's line is printed before it runs, so a failure's
output names the job.

  python tests/workers/convert_models.py --jobs '[["hf_to_megatron", IN, OUT], ...]'
"""

import argparse
import json

from megarl.models.convert import hf_to_megatron, megatron_to_hf
from megarl.parallel_state import megatron_groups

DIRECTIONS = {"hf_to_megatron": hf_to_megatron, "megatron_to_hf": megatron_to_hf}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True, help="JSON list of [direction, in_dir, out_dir]")
    args = parser.parse_args()
    # One world for every job: each conversion rebuilds its groups on it (megatron_groups.initialize).
    for direction, in_dir, out_dir in json.loads(args.jobs):
        print(json.dumps({"job": [direction, in_dir, out_dir]}), flush=True)
        DIRECTIONS[direction](in_dir, out_dir)  # as the script calls it
    megatron_groups.destroy()


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    main()
