"""``python -m lightning_rlhf.demo.model_path``: print the folder of the demo's warm-started tiny model.

Builds and caches it on first use (about a second), in ``~/.cache/lightning_rlhf`` like ``python -m
lightning_rlhf.demo``. ``recipes/demo.yaml`` takes it as the actor::

    lightning-rlhf fit --config recipes/demo.yaml --model.actor "$(python -m lightning_rlhf.demo.model_path)"
"""

from __future__ import annotations

import argparse
import os

from lightning_rlhf.demo.warmstart import prepare_demo_model


def main(argv: list[str] | None = None) -> None:
    """Print the model folder. Runs on: one process."""
    parser = argparse.ArgumentParser(prog="python -m lightning_rlhf.demo.model_path", description=__doc__)
    parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "lightning_rlhf"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(prepare_demo_model(args.cache, seed=args.seed))


if __name__ == "__main__":
    main()
