"""Worker: the HF -> Megatron converter (megarl.models.weights.convert.hf_to_megatron, what
scripts/convert.py hf-to-megatron runs under torchrun) on ranks made to choose their layer specs
differently, to see it refused where the ranks' world starts, before any model is built.

--rank-env sets variables on some ranks only (MEGARL_TRANSFORMER_ENGINE differing per rank).
--te-ranks: ranks that choose as a GPU node where Transformer Engine imports does. No rank of
this CPU machine can, so those ranks hand the real device_choice.spec_choice that node's facts
(on a GPU, auto, TE importing) under the name te-node; the gathering and the refusal are the
real ones. Each rank writes OUT_DIR/rank<r>.json: the refusal (None: converted) and whether the
output or its partial folder exists.
"""

import argparse
import json
import os

from megarl.models.weights.convert import hf_to_megatron
from megarl.parallel_state import megatron_groups
from megarl.platform import device_choice


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--rank-env", default="{}", help="JSON {rank: {variable: value}}")
    parser.add_argument("--te-ranks", default="[]", help="JSON list of ranks choosing as a TE node")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    os.environ.update(json.loads(args.rank_env).get(str(rank), {}))
    if rank in json.loads(args.te_ranks):
        device_choice.this_choice = lambda r: device_choice.spec_choice(r, "te-node", "auto", True, None)
    converted = os.path.join(args.out_dir, "megatron")
    refusal = None
    try:
        hf_to_megatron(args.hf_dir, converted)
    except RuntimeError as error:
        refusal = str(error)
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(refusal=refusal, written=os.path.exists(converted),
                       partial=os.path.exists(converted + ".partial")), f)
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
