"""torchrun worker: a vLLM engine started from an HF checkpoint (no sync) generates what
scripts/verify_sync.py generated after its sync (the same prompts, sampling and seed); rank 0
prints the samples as one JSON object {"samples": [checks.weight_sync.sample_record, ...]}."""

import argparse
import json

from megarl.checks import weight_sync as verify
from megarl.models.hf.config import load_arch
from megarl.parallel_state import megatron_groups
from megarl.rollout.vllm.engine import VLLMEngine


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    megatron_groups.init_distributed()
    arch = load_arch(args.hf_dir)
    engine = VLLMEngine(args.hf_dir, rollout_tp=args.rollout_tp, dtype=arch.dtype, seed=args.seed,
                        load_format="auto")
    prompts = verify.fixed_prompts(arch.vocab_size, args.prompts, args.seed)
    mine = [prompts[i] for i in engine.placement.share(len(prompts))]
    samples = verify.all_samples(engine.generate(mine, verify.default_sampling(args.max_new_tokens,
                                                                               args.seed)))
    if megatron_groups.is_rank0():
        print(json.dumps({"samples": [verify.sample_record(s) for s in samples]}))
    engine.shutdown()


if __name__ == "__main__":
    main()
