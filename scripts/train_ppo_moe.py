"""Train with PPO/GRPO and friends: `python scripts/train_ppo_moe.py --config configs/NAME.yaml
key.sub=value ...`. The config is loaded and validated here, before any process starts; under
torchrun every rank runs the loop directly."""

import argparse

from megarl.loop import train
from megarl.run_config import RunConfig
from megarl.typed_config import load


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="YAML file (configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    args = parser.parse_args()
    config = load(RunConfig, args.config, args.overrides)
    train(config)


if __name__ == "__main__":
    main()
