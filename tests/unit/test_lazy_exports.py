"""The package's public names load on first use (lightning_rlhf/lazy.py): a reward or tool worker that imports a
plain function from the package does not import torch, transformers or Lightning (about 7 s of CPU per worker
process), and every public name still resolves."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys

import pytest

from lightning_rlhf.lazy import type_checking_imports

LAZY_PACKAGES = ["lightning_rlhf", "lightning_rlhf.demo", "lightning_rlhf.rewards"]
HEAVY = ("torch", "transformers", "lightning", "numpy")


@pytest.mark.parametrize(
    "module",
    [
        "lightning_rlhf.demo.calculator",
        "lightning_rlhf.demo.tool_task",
        "lightning_rlhf.demo.task",
        "lightning_rlhf.rewards.math",
        "lightning_rlhf.rewards.pool",
        "lightning_rlhf.sandbox",
    ],
)
def test_worker_side_imports_stay_light(module: str) -> None:
    """What reward and tool workers import (the demo's tool and rewards, the rule rewards) pulls in no heavy
    library; nor does naming an embedded model."""
    code = (
        f"import sys, {module}\n"
        "from lightning_rlhf.config.models import EMBEDDED_MODELS\n"
        "assert 'lightning-rlhf/tiny-tools' in EMBEDDED_MODELS\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module} imported {out.strip()}"


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_public_name_resolves(package: str) -> None:
    """Each name of ``__all__`` is imported under TYPE_CHECKING and loads from that module; ``dir()`` lists it
    before first use."""
    mod = importlib.import_module(package)
    exports = type_checking_imports(mod.__file__)
    assert sorted(mod.__all__) == sorted(exports), "__all__ and the imports under TYPE_CHECKING differ"
    assert set(mod.__all__) <= set(dir(mod))
    for name in mod.__all__:
        defined_in = importlib.import_module(exports[name])
        assert getattr(mod, name) is getattr(defined_in, name), (package, name)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        mod.NoSuchName  # noqa: B018


def test_embedded_model_builders_pickle() -> None:
    """The registered builders are picklable (``functools.partial`` of a module function), so a model name's
    builder can travel to worker ranks."""
    from lightning_rlhf.config.models import EMBEDDED_MODELS

    for name, (build, _) in EMBEDDED_MODELS.items():
        again = pickle.loads(pickle.dumps(build))
        assert again.args == build.args, name
