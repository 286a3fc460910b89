"""Train with PPO/GRPO and friends: `python scripts/train_ppo_moe.py --config configs/NAME.yaml
key.sub=value ...`. The config is loaded and validated here, before any process starts. Ray
places layout.world_size workers (a local cluster unless --ray-address names one); under torchrun
every rank runs the loop directly instead. The terminal shows megarl's lines, rank 0's progress
bar and errors; each process's full output goes to run_dir/logs/ (--verbose: to the terminal).
A GPU run without Transformer Engine says so once per node when its ranks start
(megatron_groups.agree_on_layer_spec), where they are also refused if they chose different layer
specs."""

import argparse
import os

from megarl.planning.config import RunConfig
from megarl.planning.preflight import preflight
from megarl.planning.typed_config import load
from megarl.platform import device_choice
from megarl.trainer import console


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="YAML file (configs/)")
    parser.add_argument("--ray-address", help="join this Ray cluster instead of starting one")
    parser.add_argument("--resume", default=None,
                        help="'auto': continue from the newest complete checkpoint in run_dir (start "
                             "fresh if there is none); or a run_dir/checkpoints/step_NNNNNN folder")
    parser.add_argument("--verbose", action="store_true",
                        help="print every process's output (vLLM, Megatron, torch, Ray) here instead "
                             "of run_dir/logs/")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    args = parser.parse_args()
    config = load(RunConfig, args.config, args.overrides)
    # Before anything asks (the choice is cached); Ray workers inherit the variable.
    device_choice.set_transformer_engine(config.model.transformer_engine)
    # Held for the log: run_dir is made only once the config passed.
    with console.caught_warnings(args.verbose) as early:
        # A run that cannot work is refused before any process starts; the one that can, resolved
        # once, is what every rank runs.
        run = preflight(config)
    if "RANK" in os.environ:
        from megarl.trainer.loop import train

        rank = int(os.environ["RANK"])
        with console.output(config.run_dir, f"rank{rank}", args.verbose, early_warnings=early,
                            tell=rank == 0):
            train(run, args.resume)
    else:
        from megarl.trainer.launch import launch

        with console.output(config.run_dir, "driver", args.verbose, early_warnings=early, tell=True):
            launch(run, args.ray_address, args.resume, args.verbose)


if __name__ == "__main__":
    main()
