"""``python -m lightning_rlhf.demo.model_path``: print the folder of the demo's warm-started tiny model.

Builds and caches it on first use (about a second), in ``~/.cache/lightning_rlhf`` (or ``$LIGHTNING_RLHF_CACHE``)
like ``python -m lightning_rlhf.demo``. Recipes and the command line need not call it: every model setting
accepts the embedded name ``lightning-rlhf/tiny-addition``, which resolves to this folder
(see :mod:`lightning_rlhf.config.models`)::

    lightning-rlhf fit --config recipes/demo.yaml --model.actor lightning-rlhf/tiny-addition
    lightning-rlhf fit --config recipes/demo.yaml --model.actor "$(python -m lightning_rlhf.demo.model_path)"
"""

from __future__ import annotations

import argparse

from lightning_rlhf.config.models import embedded_cache_dir
from lightning_rlhf.demo.warmstart import prepare_demo_model


def main(argv: list[str] | None = None) -> None:
    """Print the model folder. Runs on: one process."""
    parser = argparse.ArgumentParser(prog="python -m lightning_rlhf.demo.model_path", description=__doc__)
    parser.add_argument("--cache", default=embedded_cache_dir())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(prepare_demo_model(args.cache, seed=args.seed))


if __name__ == "__main__":
    main()
