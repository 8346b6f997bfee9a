"""``python -m lightning_rlhf.demo``: the embedded default job (see :mod:`lightning_rlhf.demo.job`)."""

from lightning_rlhf.demo.job import main

if __name__ == "__main__":
    main()
