"""Every private access to the libraries the package builds on, one module per library, each access behind a small
named function with a test against the installed version (``tests/unit/test_compat*.py``,
``tests/unit/test_torch_compat.py``, ``tests/vllm/test_compat_vllm.py``): an upgrade that moves a private name fails
there, not in a training run. Each module states the versions it was checked on (``SUPPORTED_<LIBRARY>``), the range
``pyproject.toml`` pins (``tests/unit/test_compat_versions.py``).

- :mod:`lightning_rlhf.compat.lightning`: Lightning's private state (trainer internals, launchers, loops).
- :mod:`lightning_rlhf.compat.torch`: PyTorch's (FSDP2, DTensor, ``nn.Module`` internals).
- :mod:`lightning_rlhf.compat.sharding`: FSDP2's row-shard layout, which the weight hand-off plans its copies with.
- :mod:`lightning_rlhf.compat.peft`: peft's LoRA layout (parameter names, initial values, scale, merge, targets).
- :mod:`lightning_rlhf.compat.transformers`: transformers' (the attention a config points to, repeated blocks).
- :mod:`lightning_rlhf.compat.vllm`: vLLM's engine beyond ``LLM`` (step-by-step requests, in-place reload).

Nothing is imported here, so a module that needs one library's accessors does not import the others.
"""
