"""torchrun worker: the served teacher at --url and the colocated teacher on the same checkpoint
score one synthetic batch in a world of the given ranks; each rank saves what it got (both
teachers' log-probs and top-1 flags) and the errors every rank raised for a url that does not
answer and for a server lost after the checks, to OUT_DIR/rank{R}.pt."""

import argparse
import os

import torch
from synthetic_batch import synthetic_batch  # noqa: I001 (next to this script)

from megarl.actor.config import BatchingConfig
from megarl.models.hf.config import load_arch
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.parallel_state.megatron_groups import free_port
from megarl.teacher.colocated import ColocatedTeacher
from megarl.teacher.served import ServedTeacher


def raised(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--max-len", type=int, required=True, help="the batch's width, as the server takes")
    args = parser.parse_args()
    world = megatron_groups.init_distributed()
    dims = ParallelDims(world_size=world)
    megatron_groups.initialize(dims)
    arch = load_arch(args.hf_dir)
    batch = synthetic_batch(arch.vocab_size, max_len=args.max_len)
    served = ServedTeacher(args.url, arch.vocab_size, args.max_len, timeout_s=60.0)
    by_server = served.logprobs(batch)
    by_trainer = ColocatedTeacher(args.hf_dir, arch, dims, BatchingConfig()).logprobs(batch)
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    refused = raised(lambda: ServedTeacher(dead, arch.vocab_size, args.max_len, timeout_s=60.0))
    served.url = dead  # as if the server died after the checks
    lost = raised(lambda: served.logprobs(batch))
    torch.save({"served": (by_server.teacher_logprobs, by_server.teacher_top1),
                "colocated": (by_trainer.teacher_logprobs, by_trainer.teacher_top1),
                "refused": refused, "lost": lost, "dead_url": dead},
               os.path.join(args.out_dir, f"rank{torch.distributed.get_rank()}.pt"))
    megatron_groups.destroy()


if __name__ == "__main__":
    main()
