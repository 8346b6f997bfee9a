"""Every demo and recipe command that README.md and docs/**/*.md print runs as printed, for a few steps.

The commands are read from the pages, so a newly documented command is tested without a change here: each line
of a fenced shell block, and each inline code span, that starts with ``python -m lightning_rlhf.demo``,
``make demo`` or ``lightning-rlhf fit|sft|validate``. An optional part written ``[--flag value]`` gives two
commands, with and without it. Each runs from the repository root exactly as printed, with only a step limit
and an output folder appended (the last value of a flag wins, in argparse and in LightningCLI):

- ``python -m lightning_rlhf.demo ...`` and ``make demo`` (the Makefile's ``demo`` recipe; its ``setup``
  prerequisite is this environment): ``--steps 2 --out TMP``;
- ``lightning-rlhf fit|sft ...``: ``--trainer.max_steps 2 --trainer.logger.save_dir TMP``; ``validate``: the
  save_dir only.

``LIGHTNING_RLHF_CACHE`` points at the session's cached demo model (the demo's ``--cache`` and the embedded
model names read it), so no run repeats the warm start. A run passes when it exits with 0 and its
``metrics.csv`` has a row for each of the 2 steps, with its score or loss (``--help`` and ``--print_config`` only
print: exit 0).
The runs go one after another in one test, so that they never compete with each other for the cores.

A command is skipped only by one of the rules of :data:`SKIP_RULES`; a test checks each rule against commands
it must and must not skip.
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, failure_text

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
STEPS = 2
_STARTS = re.compile(r"^(python -m lightning_rlhf\.demo(\s|$)|make demo(\s|$)|lightning-rlhf (fit|sft|validate)\s)")
_FENCE = re.compile(r"^\s*```")
_SHELL = {"", "bash", "sh", "shell", "console", "text"}


@dataclass(frozen=True)
class Documented:
    """One printed command: where it is and its text (continuation lines joined, the trailing comment dropped)."""

    page: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def argv(self) -> list[str]:
        """The words, up to a redirection of the output (``> mine.yaml``: the test reads the output instead)."""
        words = shlex.split(self.text)
        return words[: words.index(">")] if ">" in words else words


def _variants(text: str) -> list[str]:
    """A command with an optional ``[--flag value]`` part, with and without it (each such part doubles them)."""
    m = re.search(r"\s\[(--[^\[\]]+)\]", text)
    if m is None:
        return [" ".join(text.split())]
    rest = text[m.end() :]
    return [*_variants(text[: m.start()] + rest), *_variants(f"{text[: m.start()]} {m[1]}{rest}")]


def commands_in(markdown: str, name: str) -> list[Documented]:
    """The commands a page prints: lines of its shell blocks, and inline code spans of its prose."""
    found: list[Documented] = []
    lines = markdown.splitlines()
    fence: str | None = None
    prose: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            fence = None if fence is not None else line.strip().removeprefix("```").strip()
            i += 1
            continue
        if fence is None:
            prose.append((i + 1, line))
            i += 1
            continue
        start, text = i + 1, line
        while text.rstrip().endswith("\\") and i + 1 < len(lines):  # a command continued on the next line
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i]
        i += 1
        text = text.strip().removeprefix("$ ")
        if fence not in _SHELL or not _STARTS.match(text):
            continue
        words = " ".join(shlex.split(text, comments=True, posix=False))  # the trailing `# comment` dropped
        found += [Documented(name, start, v) for v in _variants(words)]
    # inline code spans of the prose; a span may run over a line break
    text = "\n".join(t for _, t in prose)
    starts = [n for n, _ in prose]
    for m in re.finditer(r"`([^`]+)`", text):
        words = " ".join(m[1].split())
        if _STARTS.match(words):
            line = starts[text.count("\n", 0, m.start())]
            found += [Documented(name, line, v) for v in _variants(words)]
    return found


def documented_commands() -> list[Documented]:
    """Every command of the pages, the first place each is printed (a command printed twice runs once)."""
    seen: dict[str, Documented] = {}
    for page in PAGES:
        for cmd in commands_in(page.read_text(), page.relative_to(ROOT).as_posix()):
            seen.setdefault(cmd.text, cmd)
    return list(seen.values())


# ---------------------------------------------------------------------------------------------------- skip rules
def _flag(argv: list[str], name: str) -> str | None:
    """The last value of ``--name value`` or ``--name=value`` in ``argv``."""
    value = None
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(name + "="):
            value = word.split("=", 1)[1]
    return value


def _config(cmd: Documented) -> str | None:
    return _flag(cmd.argv, "--config") if cmd.argv[0] == "lightning-rlhf" else None


def _is_fragment(cmd: Documented) -> bool:
    return cmd.argv[0] == "lightning-rlhf" and _config(cmd) is None


def _is_template(cmd: Documented) -> bool:
    return any(w in ("...", "[overrides]") or re.search(r"<\w+>|\b[A-Z]{3,}\b|\|", w) for w in cmd.argv[1:])


def _config_missing(cmd: Documented) -> bool:
    config = _config(cmd)
    return config is not None and not (ROOT / config).is_file()


def _hub_model(cmd: Documented) -> bool:
    """The actor is a hub id: the recipe's ``actor:`` (or a ``--model.actor`` override) is neither an embedded
    ``lightning-rlhf/`` name nor a local folder."""
    config = _config(cmd)
    if config is None or not (ROOT / config).is_file() or "--print_config" in cmd.argv:  # printing loads nothing
        return False
    found = re.search(r"^\s*actor:\s*(\S+)", (ROOT / config).read_text(), re.MULTILINE)
    actor = _flag(cmd.argv, "--model.actor") or _flag(cmd.argv, "--model.init_args.actor")
    actor = actor or (found[1] if found else None)
    return actor is not None and "/" in actor and not actor.startswith(("lightning-rlhf/", "runs/", "/", "."))


def _missing_files(cmd: Documented) -> bool:
    """Names a checkpoint or a model folder that is not here (the reader's own, or what an earlier run writes)."""
    paths = [
        _flag(cmd.argv, "--ckpt_path"),
        _flag(cmd.argv, "--model.actor"),
        _flag(cmd.argv, "--model.init_args.actor"),
    ]
    return any(p is not None and not (ROOT / p).exists() for p in paths)


def _needs_gpu(cmd: Documented) -> bool:
    import torch

    on_gpu = re.search(r"accelerator[ =](gpu|cuda)|--precision bf16-mixed|--device-type (a100|h100|h200)", cmd.text)
    return bool(on_gpu) and not torch.cuda.is_available()


#: Why a documented command does not run here. Every other command runs.
SKIP_RULES: list[tuple[str, Callable[[Documented], bool]]] = [
    ("a template with placeholders (UPPER-CASE words, <name>, ..., a|b), not a command", _is_template),
    ("a fragment of a sentence (a `lightning-rlhf` command with no --config)", _is_fragment),
    ("its --config is a file the page has the reader write, not one of recipes/", _config_missing),
    ("its actor is a hub model (tests/e2e/test_recipes.py runs the recipe with the tiny model instead)", _hub_model),
    ("names a checkpoint or model folder that is not here (the reader's own, or an earlier run's)", _missing_files),
    ("needs a GPU, and this machine has none", _needs_gpu),
]


def skip_reason(cmd: Documented) -> str | None:
    """The first rule of :data:`SKIP_RULES` that ``cmd`` meets, or None: it runs."""
    return next((reason for reason, applies in SKIP_RULES if applies(cmd)), None)


COMMANDS = documented_commands()
RUNNABLE = [c for c in COMMANDS if skip_reason(c) is None]
SKIPPED = [c for c in COMMANDS if skip_reason(c) is not None]


# ------------------------------------------------------------------------------------------------------ running
def _makefile_recipe(target: str) -> list[str]:
    """The command of a Makefile target (one line; ``$(BIN)/`` is this interpreter's folder)."""
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{target}:.*\n\t(.+)$", text, re.MULTILINE)
    assert m is not None, f"Makefile has no one-line `{target}` recipe"
    return shlex.split(m[1].replace("$(BIN)/", f"{Path(sys.executable).parent}/"))


def invocation(cmd: Documented, out: Path) -> tuple[list[str], str | None]:
    """The argv that runs ``cmd`` (the printed words, then the step limit and the output folder) and the metric
    whose rows count the training steps (None: the command only prints)."""
    argv = cmd.argv
    if argv[:2] == ["make", "demo"]:
        argv = _makefile_recipe("demo") + argv[2:]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    elif argv[0] == "lightning-rlhf":
        argv = [str(Path(sys.executable).with_name("lightning-rlhf")), *argv[1:]]
    if "--help" in argv or "--print_config" in argv:
        return argv, None
    if "lightning_rlhf.demo" in argv:
        return [*argv, "--steps", str(STEPS), "--out", str(out)], "critic/score/mean"
    subcommand = argv[1]
    limit = [] if subcommand == "validate" else ["--trainer.max_steps", str(STEPS)]
    metric = {"fit": "critic/score/mean", "sft": "sft/loss", "validate": "val/score/mean"}[subcommand]
    return [*argv, *limit, "--trainer.logger.save_dir", str(out)], metric


def same_run(cmd: Documented) -> str:
    """What ``cmd`` runs once the step limit is appended: demo commands that differ only in ``--steps``/``--out``
    or in spelling a default (``make demo``, ``--algo grpo``) run the same job, and run once."""
    argv, metric = invocation(cmd, Path("OUT"))
    if "lightning_rlhf.demo" not in argv or metric is None:
        return shlex.join(argv)
    from lightning_rlhf.demo.job import parse_args

    settings = vars(parse_args(argv[argv.index("lightning_rlhf.demo") + 1 :]))
    return "demo " + repr(sorted((k, v) for k, v in settings.items() if k not in ("out", "cache")))


def check_run(proc: subprocess.CompletedProcess[str], out: Path, metric: str | None) -> str | None:
    """What is wrong with a run (None: it ran as documented): its exit code; for training, a ``metrics.csv`` row
    with ``timing_s/step`` for each of the steps and ``metric`` logged (the first step of an asynchronous run
    only generates, so it logs no score); for ``validate``, ``metric`` logged."""
    if proc.returncode != 0:
        return failure_text(proc)
    if metric is None:
        return None
    files = sorted(out.rglob("metrics.csv"))
    if len(files) != 1:
        return f"expected one metrics.csv under {out}, found {files}\n{failure_text(proc)}"
    with open(files[0]) as f:
        rows = list(csv.DictReader(f))
    steps = sum(bool(r.get("timing_s/step")) for r in rows)
    if not any(r.get(metric) for r in rows) or (not metric.startswith("val/") and steps != STEPS):
        return f"{files[0]}: {steps} training steps (expected {STEPS}), {metric!r} logged: no\n{failure_text(proc)}"
    return None


SAMPLE_PAGE = """Run it:

```bash
make demo   # the default job
python -m lightning_rlhf.demo --algo ppo \\
    --placement split        # a comment
lightning-rlhf export CKPT OUT
```

```python
print("python -m lightning_rlhf.demo --not-this")
```

The demo: `python -m lightning_rlhf.demo --placement rollout [--max-staleness 1]`, or a recipe:
`lightning-rlhf fit --config recipes/demo.yaml
--trainer.devices 1`; not `python -m lightning_rlhf.demo.model_path`.
"""


def test_the_commands_are_read_from_the_pages() -> None:
    """Shell lines (continued, comments dropped), inline spans (over a line break), optional parts expanded."""
    found = [(c.line, c.text) for c in commands_in(SAMPLE_PAGE, "sample.md")]
    assert found == [
        (4, "make demo"),
        (5, "python -m lightning_rlhf.demo --algo ppo --placement split"),
        (14, "python -m lightning_rlhf.demo --placement rollout"),
        (14, "python -m lightning_rlhf.demo --placement rollout --max-staleness 1"),
        (15, "lightning-rlhf fit --config recipes/demo.yaml --trainer.devices 1"),
    ]
    texts = {c.text for c in COMMANDS}
    assert "make demo" in texts and any(t.startswith("python -m lightning_rlhf.demo") for t in texts)
    assert {c.text for c in RUNNABLE} | {c.text for c in SKIPPED} == texts


def test_demo_commands_that_differ_in_steps_run_once() -> None:
    def doc(text: str) -> Documented:
        return Documented("x.md", 1, text)

    assert same_run(doc("make demo")) == same_run(doc("python -m lightning_rlhf.demo --algo grpo --steps 150"))
    assert same_run(doc("python -m lightning_rlhf.demo --algo ppo")) != same_run(doc("python -m lightning_rlhf.demo"))


def _rule(applies: Callable[[Documented], bool]) -> str:
    return next(reason for reason, rule in SKIP_RULES if rule is applies)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("python -m lightning_rlhf.demo --algo <name>", _is_template),
        ("lightning-rlhf sft --config RECIPE", _is_template),
        ("lightning-rlhf fit --ckpt_path", _is_fragment),
        ("lightning-rlhf fit --config mine.yaml", _config_missing),
        ("lightning-rlhf fit --config recipes/ppo.yaml", _hub_model),
        ("lightning-rlhf fit --config recipes/demo.yaml --model.actor Qwen/Qwen2.5-0.5B-Instruct", _hub_model),
        ("lightning-rlhf fit --config recipes/demo.yaml --ckpt_path runs/none/last.ckpt", _missing_files),
        ("lightning-rlhf fit --config recipes/demo.yaml --trainer.accelerator gpu", _needs_gpu),
        ("lightning-rlhf fit --config recipes/demo.yaml", None),
        ("lightning-rlhf fit --config recipes/demo.yaml --print_config", None),
        ("python -m lightning_rlhf.demo --algo ppo --placement split", None),
        ("make demo", None),
    ],
)
def test_each_skip_rule_picks_what_cannot_run_here(text: str, rule: Callable[[Documented], bool] | None) -> None:
    """A documented command is skipped by the rule that fits it, and one that can run here runs."""
    import torch

    if rule is _needs_gpu and torch.cuda.is_available():
        rule = None  # on a GPU machine it runs
    assert skip_reason(Documented("x.md", 1, text)) == (None if rule is None else _rule(rule))


def test_commands_skipped_for_a_hub_model_run_in_the_recipe_tests() -> None:
    """The hub-model rule's reason says tests/e2e/test_recipes.py runs that recipe with the tiny model instead."""
    from tests.e2e.test_recipes import RECIPES

    hub = [c for c in SKIPPED if skip_reason(c) == _rule(_hub_model)]
    assert hub, "README.md and docs/cli.md print recipes with a hub model: the rule must find them"
    for cmd in hub:
        config = _config(cmd)
        assert config is not None and Path(config).stem in RECIPES and Path(config).stem != "grpo_lora", cmd.where


@pytest.mark.slow
def test_documented_commands_run_as_printed(demo_model: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "LIGHTNING_RLHF_CACHE": str(Path(demo_model).parent),
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
    }
    runs: dict[str, list[Documented]] = {}
    for cmd in RUNNABLE:
        runs.setdefault(same_run(cmd), []).append(cmd)
    failures, timings = [], []
    for k, cmds in enumerate(runs.values()):
        out = tmp_path / f"run{k}"
        argv, metric = invocation(cmds[0], out)
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=str(ROOT), env=env)
        where = ", ".join(c.where for c in cmds)
        timings.append(f"{time.perf_counter() - start:6.1f} s  {cmds[0].text}  ({where})")
        problem = check_run(proc, out, metric)
        if problem is not None:
            failures.append(f"{where}: `{cmds[0].text}` (ran {shlex.join(argv)})\n{problem}")
    print("\n".join(timings))
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------- vLLM on part of the ranks (issues 31, 32)
def test_vllm_pool_check_names_the_setting_and_the_fix() -> None:
    """A role on part of the ranks gets one engine server per rank: any pool serves TP 1; a tensor-parallel group
    must divide the pool and sit on one node (its servers meet on their host)."""
    from lightning_rlhf.placement.pools import check_vllm_pools

    pools = {"actor": (0,), "reward": (0,), "rollout": (1, 2, 3, 4)}
    check_vllm_pools(pools, ["rollout"], 5, tp_size=1, processes_per_node=1)  # servers of their own: fine
    check_vllm_pools(pools, ["rollout"], 5, tp_size=2, processes_per_node=5)  # groups (1, 2), (3, 4) on one node
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the 4 ranks of 'rollout'"):
        check_vllm_pools(pools, ["rollout"], 5, tp_size=3, processes_per_node=5)
    with pytest.raises(ValueError) as err:
        check_vllm_pools(pools, ["rollout"], 5, tp_size=2, processes_per_node=2)  # nodes (0, 1), (2, 3), (4,)
    assert "groups ranks [1, 2] of the pool of 'rollout' [1, 2, 3, 4], which sit on different nodes" in str(err.value)
    assert "HINT: place the pool on whole nodes" in str(err.value)
    check_vllm_pools({"actor": (0, 1)}, ["actor"], 2, tp_size=2, processes_per_node=1)  # every rank: colocated
