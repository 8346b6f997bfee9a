"""Every Lightning private access in ``compat.lightning``, against the installed Lightning: each test checks
that the private attribute is there, has the expected type, and that the compat function has its intended effect
on a real ``Trainer`` (CPU, single process, a tiny LightningModule) or ``ModelParallelStrategy``. The last tests
check that no other module of the package touches Lightning's private names, so a new use fails here."""

from __future__ import annotations

import ast
import contextlib
import csv
import functools
import importlib
import inspect
import json
import os
import pkgutil
import re
import signal
import socket
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning
import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

import lightning_rlhf
from lightning_rlhf.compat import lightning as compat
from lightning_rlhf.compat.lightning import (
    SUPPORTED_LIGHTNING,
    DeferringChildObserver,
    SubprocessScriptLauncher,
    attached_trainer,
    batches_that_stepped,
    check_lightning_version,
    count_optimizer_step,
    request_stop,
    run_validation_between_steps,
    set_batches_that_stepped,
    set_data_parallel_size,
    set_launcher,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(lightning_rlhf.__file__).resolve().parent
HINT = f"pip install 'lightning{SUPPORTED_LIGHTNING}'"


# ------------------------------------------------------------------------------------------ a tiny module
class Tiny(L.LightningModule):
    """A linear layer on random vectors; records the order of its training and validation steps."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.automatic_optimization = not manual
        self.events: list[str] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        self.events.append("train")
        loss = self.layer(batch).pow(2).mean()
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        if not self.automatic_optimization:  # steps no optimizer Lightning knows of, like RLHFStrategy's roles
            return None
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.events.append("val")
        self.log("val_loss", self.layer(batch).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        return DataLoader(torch.randn(16, 4), batch_size=2)  # type: ignore[arg-type]

    def val_dataloader(self) -> DataLoader[torch.Tensor]:
        return DataLoader(torch.randn(4, 4), batch_size=2)  # type: ignore[arg-type]


class Hook(L.Callback):
    """Calls ``fn(trainer, batch_idx)`` at one callback hook."""

    def __init__(self, hook: str, fn: Callable[[L.Trainer, int], None]) -> None:
        self.hook, self.fn = hook, fn

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.hook == "on_train_start":
            self.fn(trainer, -1)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.hook == "on_train_batch_start":
            self.fn(trainer, idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self.hook == "on_train_batch_end":
            self.fn(trainer, idx)


def trainer_in(tmp_path: Path, *callbacks: L.Callback, **kwargs: Any) -> L.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "default_root_dir": str(tmp_path),
        "logger": CSVLogger(str(tmp_path), name="run", version=0),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "limit_val_batches": 0,
        "callbacks": list(callbacks),
    }
    settings.update(kwargs)
    return L.Trainer(**settings)


def logged_steps(tmp_path: Path, key: str) -> list[int]:
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get(key)]


# ------------------------------------------------------------------------------------------ the version
def test_installed_lightning_is_in_the_supported_range() -> None:
    check_lightning_version()
    check_lightning_version(lightning.__version__)


@pytest.mark.parametrize("version", ["2.6.0", "2.6.6", "2.6.10", "2.6.1rc1", "2.6.6+cpu"])
def test_versions_inside_the_range_pass(version: str) -> None:
    check_lightning_version(version)


@pytest.mark.parametrize("version", ["2.5.5", "2.7.0", "2.7.0rc1", "3.0", "1.9.5"])
def test_versions_outside_the_range_name_the_range_and_the_fix(version: str) -> None:
    with pytest.raises(RuntimeError) as info:
        check_lightning_version(version)
    text = str(info.value)
    assert f"lightning {version} is installed" in text
    assert SUPPORTED_LIGHTNING in text and HINT in text


def test_a_malformed_version_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as info:
        check_lightning_version("two.six")
    assert "'two.six' is not a valid version" in str(info.value) and HINT in str(info.value)


def test_pyproject_pins_the_supported_range() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if re.match(r"lightning\b(?!-)", d)] == [f"lightning{SUPPORTED_LIGHTNING}"]


def test_the_strategy_checks_the_version_when_constructed(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_rlhf import RLHFStrategy

    RLHFStrategy(rollout="hf")
    monkeypatch.setattr(lightning, "__version__", "2.7.1")
    with pytest.raises(RuntimeError, match=re.escape(HINT)):
        RLHFStrategy(rollout="hf")


# ------------------------------------------------------------------------------------------ the loops
def test_set_batches_that_stepped_moves_the_logged_step(tmp_path: Path) -> None:
    seen: list[int] = []

    def jump(trainer: L.Trainer, idx: int) -> None:
        assert isinstance(trainer.fit_loop.epoch_loop._batches_that_stepped, int)
        if idx == 1:
            set_batches_that_stepped(trainer, 10)

    trainer = trainer_in(
        tmp_path,
        Hook("on_train_batch_start", jump),
        Hook("on_train_batch_end", lambda t, i: seen.append(batches_that_stepped(t))),
        max_steps=3,
    )
    trainer.fit(Tiny())
    assert seen == [0, 10, 11]  # what a callback reads (step_of) is where the logger put the batch's metrics
    assert logged_steps(tmp_path, "train_loss") == [0, 10, 11]
    assert trainer.global_step == 3  # the optimizer-step count is separate


def test_count_optimizer_step_drives_global_step(tmp_path: Path) -> None:
    progress = trainer_in(tmp_path).fit_loop.epoch_loop.manual_optimization.optim_step_progress
    assert callable(progress.increment_ready) and callable(progress.increment_completed)

    uncounted = Tiny(manual=True)
    trainer = trainer_in(tmp_path / "a", max_epochs=1, limit_train_batches=3)
    trainer.fit(uncounted)
    assert (trainer.global_step, uncounted.events.count("train")) == (0, 3)  # no optimizer step Lightning saw

    counted = Tiny(manual=True)
    trainer = trainer_in(tmp_path / "b", Hook("on_train_batch_end", lambda t, i: count_optimizer_step(t)), max_steps=2)
    trainer.fit(counted)
    assert (trainer.global_step, counted.events.count("train")) == (2, 2)  # max_steps counts the counted steps


def test_request_stop_ends_fit_after_the_batch_and_can_be_withdrawn(tmp_path: Path) -> None:
    trainer = trainer_in(tmp_path / "a", max_steps=5)
    assert trainer._signal_connector.received_sigterm is False

    def stop_after_second(trainer: L.Trainer, idx: int) -> None:
        if idx == 1:
            request_stop(trainer, True)
            assert trainer.received_sigterm is True

    module = Tiny()
    trainer = trainer_in(tmp_path / "b", Hook("on_train_batch_end", stop_after_second), max_steps=5)
    with pytest.raises(SIGTERMException):
        trainer.fit(module)
    assert (trainer.global_step, module.events.count("train")) == (2, 2)

    def stop_then_withdraw(trainer: L.Trainer, idx: int) -> None:
        request_stop(trainer, True)
        request_stop(trainer, False)

    trainer = trainer_in(tmp_path / "c", Hook("on_train_batch_end", stop_then_withdraw), max_steps=3)
    trainer.fit(Tiny())
    assert trainer.global_step == 3 and trainer.received_sigterm is False


def test_run_validation_between_steps_validates_first_and_keeps_step_logging(tmp_path: Path) -> None:
    results: list[tuple[bool, Any, Any, bool]] = []

    def validate(trainer: L.Trainer, idx: int) -> None:
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        assert isinstance(val_loop.restarting, bool) and isinstance(val_loop.skip, bool)
        before = trainer._logger_connector._first_loop_iter
        assert before is None or isinstance(before, bool)
        ran = run_validation_between_steps(trainer)
        results.append((ran, before, trainer._logger_connector._first_loop_iter, trainer.training))

    module = Tiny()
    trainer = trainer_in(
        tmp_path / "a", Hook("on_train_start", validate), max_epochs=1, limit_train_batches=2, limit_val_batches=2
    )
    trainer.fit(module)
    assert results == [(True, None, None, True)]
    assert module.events == ["val", "val", "train", "train", "val", "val"]  # then the usual end-of-epoch one
    assert logged_steps(tmp_path / "a", "train_loss") == [0, 1]  # step-level logging unaffected
    assert logged_steps(tmp_path / "a", "val_loss") == [0, 1]  # before step 0; at the last step's end

    results.clear()
    module = Tiny()
    trainer_in(tmp_path / "b", Hook("on_train_start", validate), max_steps=1, limit_val_batches=0).fit(module)
    assert results[0][0] is False and module.events == ["train"]  # nothing to validate on


def test_attached_trainer(tmp_path: Path) -> None:
    module = Tiny()
    assert attached_trainer(module) is None
    with pytest.raises(RuntimeError):
        module.trainer  # noqa: B018  (the public property raises where attached_trainer answers None)
    trainer = trainer_in(tmp_path, max_steps=1)
    trainer.fit(module)
    assert attached_trainer(module) is trainer


# ------------------------------------------------------------------------------------------ the strategy
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_checkpoint_metadata_filename_is_the_file_a_sharded_save_writes(tmp_path: Path) -> None:
    from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

    from lightning_rlhf.compat.lightning import checkpoint_metadata_filename

    name = checkpoint_metadata_filename()
    assert name == "meta.pt"
    (tmp_path / name).write_bytes(b"")
    assert _is_sharded_checkpoint(tmp_path)  # Lightning recognises a folder by this file


def test_set_data_parallel_size_shapes_the_device_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = ModelParallelStrategy(tensor_parallel_size=1)
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False)
    strategy.connect(Tiny())
    assert strategy._data_parallel_size == "auto"
    assert not torch.distributed.is_initialized()
    try:
        set_data_parallel_size(strategy, 2)
        with pytest.raises(RuntimeError, match=r"data_parallel_size=2"):  # Lightning built the mesh from our size
            strategy.setup_environment()
        set_data_parallel_size(strategy, 1)
        strategy.setup_environment()
        assert strategy.device_mesh["data_parallel"].size() == 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    with pytest.raises(TypeError, match="ModelParallelStrategy"):
        set_data_parallel_size(SingleDeviceStrategy("cpu"), 2)


class HookedStrategy(ModelParallelStrategy):
    """Records Lightning's call of the private ``_configure_launcher`` hook and installs its own launcher."""

    def __init__(self) -> None:
        super().__init__(tensor_parallel_size=1)
        self.configured = 0

    def _configure_launcher(self) -> None:
        self.configured += 1
        assert self.cluster_environment is not None
        set_launcher(self, SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes))


def test_set_launcher_from_the_configure_launcher_hook() -> None:
    assert Strategy.__dict__.get("_configure_launcher") is not None  # the hook a strategy overrides
    assert ModelParallelStrategy(tensor_parallel_size=1)._launcher is None
    strategy = HookedStrategy()
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False)
    assert strategy.configured == 1
    launcher = strategy.launcher
    assert isinstance(launcher, SubprocessScriptLauncher) and launcher.procs == []
    set_launcher(strategy, None)
    assert strategy.launcher is None


def test_rlhf_strategy_installs_its_launcher() -> None:
    from lightning_rlhf import RLHFStrategy
    from lightning_rlhf.controller.launcher import RLHFLauncher

    strategy = RLHFStrategy(rollout="hf")
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False)
    assert isinstance(strategy.launcher, RLHFLauncher)


# ------------------------------------------------------------------------------------------ the launcher
@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing in for rank 0, which Lightning's observer SIGKILLs when a child fails."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def failed_child() -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    child.wait()
    return child


def test_child_observer_stands_aside_while_deferring(victim: subprocess.Popen[bytes]) -> None:
    child = failed_child()
    observer = DeferringChildObserver(victim.pid, [child], defer=lambda: True, sleep_period=0.05)
    assert observer._child_processes == [child]
    observer.start()
    observer.join(timeout=30)
    assert not observer.is_alive()  # every child has exited: the observer is done
    assert victim.poll() is None  # and nobody was killed


def test_child_observer_does_what_lightnings_does_otherwise(victim: subprocess.Popen[bytes]) -> None:
    observer = DeferringChildObserver(victim.pid, [failed_child()], defer=lambda: False, sleep_period=0.05)
    observer.start()
    assert victim.wait(timeout=30) == -signal.SIGKILL  # Lightning's _run: a failed child takes the main process down
    observer.join(timeout=30)
    assert not observer.is_alive()


LAUNCH_SCRIPT = """
import json, os, sys
if os.environ.get("LOCAL_RANK", "0") != "0":
    print(json.dumps({"child": os.environ["LOCAL_RANK"], "world": os.environ["WORLD_SIZE"]}), flush=True)
    sys.exit(0)
os.environ.pop("OMP_NUM_THREADS", None)
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_rlhf.compat.lightning import SubprocessScriptLauncher, start_subprocess_ranks
launcher = SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
start_subprocess_ranks(launcher, defer_observer=lambda: True)
codes = [p.wait(timeout=120) for p in launcher.procs]
print(json.dumps({"codes": codes, "omp": os.environ.get("OMP_NUM_THREADS")}), flush=True)
"""


def test_start_subprocess_ranks_starts_the_other_ranks(tmp_path: Path) -> None:
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(LAUNCH_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=str(ROOT), env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {"child": "1", "world": "2"} in lines  # Lightning re-ran the script as rank 1 of 2
    parent = next(line for line in lines if "codes" in line)
    assert parent["codes"] == [0] and parent["omp"] is not None and int(parent["omp"]) >= 1


# ------------------------------------------------------------------------------------------ nowhere else
@functools.cache
def lightning_private_names() -> frozenset[str]:
    """Every private name Lightning's own source defines: attributes it assigns on ``self``, its functions, classes,
    module-level names (not the private names of other libraries that it reads, such as ``torch._C``, nor those a
    torch tensor has: ``tensor._version`` is the tensor's version counter, whatever Lightning's loggers call theirs)."""
    names: set[str] = set()
    for path in Path(lightning.__file__).resolve().parent.rglob("*.py"):
        text = path.read_text(errors="ignore")
        names.update(re.findall(r"self\.(_[A-Za-z]\w*)\s*(?::[^=\n]+)?=(?!=)", text))
        names.update(re.findall(r"^\s*(?:def|class)\s+(_[A-Za-z]\w*)", text, re.MULTILINE))
        names.update(re.findall(r"^(_[A-Za-z]\w*)\s*[:=]", text, re.MULTILINE))
    return frozenset(n for n in names if not n.startswith("__") and not hasattr(torch.Tensor, n))


LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "compat" / "lightning.py")


def private_lightning_uses(path: Path) -> list[str]:
    """``file:line: what`` for each private Lightning import and each ``obj._name`` (obj not self/cls) with a name
    Lightning uses."""
    found: list[str] = []
    where = path.relative_to(ROOT)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIGHTNING_PACKAGES:
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private or any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{where}:{node.lineno}: from {node.module} import {', '.join(private) or '...'}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIGHTNING_PACKAGES and any(p.startswith("_") for p in parts):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue  # see the next test
            if node.attr in lightning_private_names():
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_compat_touches_lightning_private_names() -> None:
    lightnings = lightning_private_names()
    assert {"_batches_that_stepped", "_signal_connector", "_first_loop_iter", "_launcher"} <= lightnings
    assert "_C" not in lightnings and "_parameters" not in lightnings  # torch's, which Lightning only reads
    assert "_version" not in lightnings  # a tensor's (Lightning's loggers have a `self._version` of their own)
    assert private_lightning_uses(
        PACKAGE / "compat" / "lightning.py"
    )  # and would see compat's uses, were they elsewhere
    offenders = [use for path in package_files() for use in private_lightning_uses(path)]
    assert offenders == [], (
        "Lightning private state used outside lightning_rlhf/compat/lightning.py:\n  " + "\n  ".join(offenders) + "\n"
        "HINT: add a named function to compat/lightning.py (docstring: the private attribute and why) with a "
        "test in tests/unit/test_compat.py, and call it instead."
    )


# Private Lightning hooks a subclass may override; each is exercised above (test_set_launcher_from_the_...).
ALLOWED_OVERRIDES = {("RLHFStrategy", "_configure_launcher")}
# Known uses waiting for their file's owner to switch to compat (remove an entry once its use is gone).
PENDING: set[tuple[str, str]] = set()  # uses waiting to move into compat/lightning.py (none left)


def lightning_bases(cls: type) -> list[type]:
    return [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in LIGHTNING_PACKAGES]


@functools.cache
def names_lightning_class_uses(base: type) -> frozenset[str]:
    names = {n for n in vars(base) if n.startswith("_") and not n.startswith("__")}
    with contextlib.suppress(OSError, TypeError):  # a class without Python source: its dict is all there is
        names.update(re.findall(r"self\.(_[A-Za-z]\w*)", inspect.getsource(base)))
    return frozenset(n for n in names if not n.startswith("__"))


def own_private_names(cls: type) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
            and node.attr.startswith("_")
        ):
            names.add(node.attr)
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    names.update(n.name for n in body.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def package_classes() -> Iterator[type]:
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="lightning_rlhf."):
        if info.name.endswith("__main__") or info.name == compat.__name__:
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and obj.__module__ == info.name:
                yield obj


def test_no_subclass_uses_lightnings_private_state_through_self() -> None:
    clashes: list[str] = []
    checked = set()
    for cls in package_classes():
        bases = lightning_bases(cls)
        if not bases:
            continue
        checked.add(cls.__name__)
        theirs = set().union(*(names_lightning_class_uses(b) for b in bases))
        for name in sorted(own_private_names(cls) & theirs):
            if (cls.__name__, name) not in ALLOWED_OVERRIDES | PENDING:
                clashes.append(f"{cls.__module__}.{cls.__name__}: self.{name}")
    assert {"RLHFStrategy", "RLHFLauncher", "ExternalLauncher", "RLHFModule"} <= checked
    assert clashes == [], (
        "Lightning private state (or a name clash with it) through self:\n  " + "\n  ".join(clashes) + "\n"
        "HINT: reach Lightning's attribute through a named function in compat/lightning.py (with a test here); "
        "rename an attribute of your own that happens to share Lightning's name."
    )


class Leaky(ModelParallelStrategy):
    """What the check above must catch: Lightning's private attribute set directly through ``self``."""

    def setup_environment(self) -> None:
        self._data_parallel_size = 2
        self._own_counter = 0
        super().setup_environment()


def test_the_self_check_catches_a_direct_use() -> None:
    theirs = set().union(*(names_lightning_class_uses(b) for b in lightning_bases(Leaky)))
    assert own_private_names(Leaky) & theirs == {"_data_parallel_size"}
