"""README.md's claims stay in step with the code: what it names exists, and what it must not say it does not say.

Everything is parsed from the README, so a new mention is checked without a change here:

- ``lightning_rlhf`` names: the ``from lightning_rlhf... import`` lines of its Python blocks, and inline code that
  names a class (``RLHFStrategy(placement="auto")``: the class, and each keyword a parameter of it), a module
  (``lightning_rlhf.x``), a path (``lightning_rlhf/...``, ``recipes/...``) or a snake_case function (in the source);
- environment variables (``LIGHTNING_RLHF_*``), read somewhere in the package;
- ``make`` targets, in the Makefile; relative links, to files (and headings, for ``#anchors``) that exist;
- command lines: ``python -m lightning_rlhf.demo ...`` parses with the demo's own parser, ``lightning-rlhf SUB``
  names a subcommand, its ``--config`` a file, its flags ones the subcommand reads;
- :data:`FORBIDDEN`: deleted or misleading things that must not come back; the "Not there yet" list names nothing
  that has a guide (:data:`LANDED`); the first code block is the newcomer's two commands, the pip lines after;
- the headline script's reward scores a chatty correct answer 1.

The package's own docstrings are held to one rule of the same kind: a ``:mod:`` reference names a module that
exists (``cpu/switches.py`` cited a deleted one).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import re
import shlex
from typing import Any

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
PACKAGE = ROOT / "lightning_rlhf"
SOURCE = "\n".join(path.read_text(encoding="utf-8") for path in sorted(PACKAGE.rglob("*.py")))

#: Text the README must not hold, with why.
FORBIDDEN: dict[str, str] = {
    "LIGHTNING_RLHF_NATIVE": "a legacy variable: the CPU speed layer's switch is LIGHTNING_RLHF_CPU_KERNELS",
    "optimizer's kernels": "deleted with the mirrored AdamW (lightning_rlhf/cpu/__init__.py)",
    "gpu-wheels": "a maintainer's target for lent GPU machines (benchmarks/gpu_check.sh), not a user's",
    "c.strip() == a": "an exact-match reward: a chatty model's '3 + 4 = 7' scores 0, so it cannot learn",
    "pip install 'lightning-rlhf": "the package is not published: install from a clone",
    'pip install "lightning-rlhf': "the package is not published: install from a clone",
    "pip install lightning-rlhf": "the package is not published: install from a clone",
}

#: Features that have landed, each with the guide that proves it: "Not there yet" may name none of them.
LANDED: dict[str, str] = {
    "LoRA": "docs/lora.md",
    "agentic": "docs/agents.md",
    "tools": "docs/agents.md",
    "environments": "docs/agents.md",
    "SFT": "docs/sft.md",
    "supervised": "docs/sft.md",
    "placement": "docs/placement.md",
    "export": "docs/cli.md",
    "activation checkpointing": "docs/performance.md",
    "sequence parallelism": "docs/performance.md",
}

#: Inline-code class names that are not the package's (none yet).
THIRD_PARTY: set[str] = set()

_FENCE = re.compile(r"^```(\w*)\s*$")


def code_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, body, first line)`` of each fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m:
            start = i
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            blocks.append((m[1], "\n".join(lines[start + 1 : i]), start + 1))
        i += 1
    return blocks


def prose(text: str) -> str:
    """The text outside fenced blocks and HTML comments."""
    lines, out, inside = text.splitlines(), [], False
    for line in lines:
        if _FENCE.match(line) or line.strip() == "```":
            inside = not inside
            continue
        if not inside:
            out.append(line)
    return re.sub(r"<!--.*?-->", "", "\n".join(out), flags=re.DOTALL)


def inline_code(text: str) -> list[str]:
    """The inline code spans of the prose (a span may wrap a line)."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose(text))]


def command_lines(text: str) -> list[str]:
    """Shell commands: each line of the shell blocks (comments dropped) and each inline span that reads as one."""
    found = []
    for lang, body, _ in code_blocks(text):
        if lang in ("", "bash", "sh", "shell"):
            found += [line.split(" #")[0].strip() for line in body.splitlines()]
    found += inline_code(text)
    return [line for line in found if line and not line.startswith("#")]


def python_blocks(text: str) -> list[str]:
    return [body for lang, body, _ in code_blocks(text) if lang == "python"]


def slug(heading: str) -> str:
    """The anchor mkdocs (and GitHub) give a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


# ---------------------------------------------------------------------------------------------------------------------
# What the README must and must not say


@pytest.mark.parametrize("text", sorted(FORBIDDEN))
def test_readme_says_nothing_deleted_or_misleading(text: str) -> None:
    assert text not in README, f"README.md holds {text!r}: {FORBIDDEN[text]}"


def test_no_page_installs_the_package_from_pypi() -> None:
    """The package is not published: every page says to install from a clone (``pip install -e ".[vllm]"``)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pattern = re.compile(r"pip install ['\"]?lightning[-_]rlhf\b")
    found = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in pages
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "pages install the unpublished package from PyPI:\n" + "\n".join(found)


def test_not_there_yet_names_nothing_that_landed() -> None:
    m = re.search(r"\*\*Not there yet\*\*:(.*?)(?:\n\n|\n- |\n#)", README, re.DOTALL)
    assert m, "README.md's Maturity section has no '**Not there yet**:' item"
    missing = " ".join(m[1].split())
    for word, guide in LANDED.items():
        assert (ROOT / guide).is_file(), f"LANDED names {guide} for {word!r}: no such page"
        assert not re.search(rf"\b{word}\b", missing, re.IGNORECASE), (
            f"README.md says {word!r} is not there yet ({missing!r}), but it has landed: {guide}"
        )


def test_first_code_block_is_the_newcomers_two_commands_then_the_pip_lines() -> None:
    blocks = code_blocks(README)
    _, body, first = blocks[0]
    commands = [line.split("#")[0].strip() for line in body.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"], f"README.md:{first}: the first block runs {commands}"
    first_pip = min(line for _, body, line in blocks if "pip install" in body)
    assert first_pip > first
    assert first < 25, "the two commands belong on the first screen"
    screen = "\n".join(README.splitlines()[:40])
    assert "Linux x86_64" in screen, "the first screen says which OS and CPU architecture the project runs on"
    assert re.search(r"\*\*For\*\* Lightning users", screen), "the first screen says who the project is for"


def test_layout_links_the_agents_and_lora_guides() -> None:
    layout = README[README.index("## Layout") :]
    layout = layout[: layout.index("\n## ", 1)]
    for guide in ("docs/agents.md", "docs/lora.md"):
        assert f"]({guide})" in layout, f"README.md's layout does not link {guide}"


def test_headline_script_reward_reads_the_final_number() -> None:
    """The script's reward scores '3 + 4 = 7' 1 for the answer 7: an exact match scores it 0 and cannot learn."""
    script = next(body for body in python_blocks(README) if "GRPOModule(" in body and "trainer.fit" in body)
    namespace: dict[str, Any] = {"__name__": "readme_script"}  # the `if __name__ == "__main__":` part stays off
    exec(compile(script, "<README script>", "exec"), namespace)
    call = next(
        node
        for node in ast.walk(ast.parse(script))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "GRPOModule"
    )
    expr = next(kw.value for kw in call.keywords if kw.arg == "reward")
    reward = eval(compile(ast.Expression(expr), "<reward>", "eval"), namespace)
    completions = ["3 + 4 = 7", "The answer is 7.", "7", "3 + 4 = 8"]
    scores = reward(prompts=["3+4="] * 4, completions=completions, answer=["7"] * 4)
    assert list(scores) == [1.0, 1.0, 1.0, 0.0], dict(zip(completions, scores, strict=True))


# ---------------------------------------------------------------------------------------------------------------------
# The names, variables, targets, links and flags it mentions exist


def imported_names() -> list[tuple[str, str]]:
    """``(module, name)`` of each ``from lightning_rlhf... import name`` in the README's Python blocks."""
    found = []
    for body in python_blocks(README):
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_rlhf"):
                found += [(node.module or "", alias.name) for alias in node.names]
    return found


def test_imported_names_exist() -> None:
    names = imported_names()
    assert names, "README.md imports nothing from lightning_rlhf: the parser is broken"
    missing = [f"{mod}.{name}" for mod, name in names if not hasattr(importlib.import_module(mod), name)]
    assert not missing, f"README.md imports names that do not exist: {missing}"


def test_inline_classes_and_their_keywords_exist() -> None:
    import lightning_rlhf

    spans = [s for s in inline_code(README) if re.match(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*(\(.*\))?$", s)]
    assert len(spans) >= 5, spans
    problems = []
    for span in spans:
        name = span.split("(")[0]
        if name in THIRD_PARTY:
            continue
        obj = getattr(lightning_rlhf, name, None)
        if obj is None:
            problems.append(f"`{span}`: lightning_rlhf has no {name}")
            continue
        if "(" in span:
            call = ast.parse(span, mode="eval").body
            assert isinstance(call, ast.Call)
            params = inspect.signature(obj).parameters
            problems += [f"`{span}`: {name} takes no {kw.arg}=" for kw in call.keywords if kw.arg not in params]
    assert not problems, "\n".join(problems)


def test_inline_paths_modules_and_functions_exist() -> None:
    problems = []
    checked = 0
    for span in inline_code(README):
        if re.match(r"(lightning_rlhf|recipes|docs|benchmarks|tests)/\S*$", span):
            checked += 1
            if not (ROOT / span).exists():
                problems.append(f"`{span}`: no such path")
        elif re.match(r"lightning_rlhf(\.\w+)+$", span):
            checked += 1
            module, _, attr = span.rpartition(".")
            if importlib.util.find_spec(span) is None and not hasattr(importlib.import_module(module), attr):
                problems.append(f"`{span}`: no such module or name")
        elif re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", span):
            checked += 1
            if not re.search(rf"\b{span}\b", SOURCE):
                problems.append(f"`{span}`: not in the package's source")
    assert checked >= 5, "the parser found almost nothing to check"
    assert not problems, "\n".join(problems)


def test_environment_variables_are_read_by_the_package() -> None:
    names = set(re.findall(r"\bLIGHTNING_RLHF_[A-Z_]*[A-Z]\b", README))
    assert names, "README.md names no environment variable (the CPU switch belongs in the install notes)"
    missing = sorted(name for name in names if f'"{name}"' not in SOURCE)
    assert not missing, f"README.md names environment variables the package does not read: {missing}"


def test_make_targets_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.MULTILINE))
    mentioned = {m[1] for line in command_lines(README) for m in re.finditer(r"\bmake ([a-z][\w-]*)", line)}
    assert {"demo", "test"} <= mentioned
    missing = sorted(mentioned - targets)
    assert not missing, f"README.md runs make targets the Makefile does not have: {missing}"


def test_relative_links_and_anchors_exist() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", prose(README))
    problems = []
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        if not target.exists():
            problems.append(f"({link}): no such file")
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.MULTILINE)
            if anchor not in {slug(h) for h in headings}:
                problems.append(f"({link}): {path} has no heading #{anchor}")
    assert len(links) >= 10, links
    assert not problems, "\n".join(problems)


def demo_commands() -> list[str]:
    return [line for line in command_lines(README) if line.startswith("python -m lightning_rlhf.demo")]


def cli_commands() -> list[str]:
    return [line for line in command_lines(README) if re.match(r"lightning-rlhf \w", line)]


def test_demo_command_lines_parse() -> None:
    from lightning_rlhf.demo.job import build_parser

    commands = demo_commands()
    assert len(commands) >= 3, commands
    problems = []
    for line in commands:
        argv = shlex.split(line)[3:]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser().parse_args(argv)
        except SystemExit:
            problems.append(f"{line}: {err.getvalue().strip().splitlines()[-1]}")
    assert not problems, "\n".join(problems)


def _subcommands() -> set[str]:
    from lightning_rlhf.cli import RLHFCLI

    own = set(re.findall(r'argv\[:1\] == \["(\w+)"\]', (PACKAGE / "cli.py").read_text()))
    return own | set(RLHFCLI.subcommands())


def _flags_of(sub: str) -> set[str] | None:
    """The flags ``lightning-rlhf SUB`` reads, where a plain parser gives them (None: LightningCLI's own keys)."""
    if sub == "export":
        from lightning_rlhf.cli import export_parser

        parser: Any = export_parser()
        return {opt for action in parser._actions for opt in action.option_strings}
    if sub == "plan":
        source = inspect.getsource(importlib.import_module("lightning_rlhf.placement.plan").main)
        return set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', source))
    return None


def test_cli_command_lines_name_real_subcommands_files_and_flags() -> None:
    commands = cli_commands()
    subcommands = _subcommands()
    assert {"fit", "sft", "export", "plan"} <= subcommands
    problems = []
    for line in [c for c in commands if len(shlex.split(c)) > 2]:
        words = shlex.split(line)
        sub = words[1]
        if sub not in subcommands:
            problems.append(f"{line}: no subcommand {sub!r} (there are {sorted(subcommands)})")
            continue
        if "--config" in words:
            config = words[words.index("--config") + 1]
            if not (ROOT / config).is_file():
                problems.append(f"{line}: no such recipe {config}")
        flags = _flags_of(sub)
        if flags is not None:
            problems += [f"{line}: {sub} reads no {w}" for w in words if w.startswith("--") and w not in flags]
    assert len(commands) >= 3, commands
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_should() -> None:
    """The parsers find a deleted name, a missing target, a broken anchor and an unknown flag."""
    bad = (
        "Try `RLHFStrategy(no_such_setting=1)` and `make no-such-target`, see [x](docs/performance.md#no-such).\n"
        "```bash\npython -m lightning_rlhf.demo --no-such-flag\n```\n"
    )
    assert "RLHFStrategy(no_such_setting=1)" in inline_code(bad)
    assert "make no-such-target" in command_lines(bad)
    assert "python -m lightning_rlhf.demo --no-such-flag" in command_lines(bad)
    from lightning_rlhf import RLHFStrategy
    from lightning_rlhf.demo.job import build_parser

    assert "no_such_setting" not in inspect.signature(RLHFStrategy).parameters
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        build_parser().parse_args(["--no-such-flag"])
    assert slug("On a GPU") == "on-a-gpu" and slug("Running on a cluster (Slurm)") == "running-on-a-cluster-slurm"


# ---------------------------------------------------------------------------------------------------------------------
# The package's docstrings


def test_docstring_module_references_exist() -> None:
    refs = set(re.findall(r":mod:`~?(lightning_rlhf(?:\.\w+)*)`", SOURCE))
    assert len(refs) >= 10, refs
    missing = sorted(ref for ref in refs if importlib.util.find_spec(ref) is None)
    assert not missing, f"docstrings cite modules that do not exist: {missing}"
