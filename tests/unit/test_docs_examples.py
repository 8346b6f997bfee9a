"""The Python examples of the docs (``docs/**/*.md``, ``README.md``) run in the test suite, so they cannot rot.

Every fenced ``python`` block runs, in page order, in one namespace per page (a later block may use the names
an earlier one defined, as a reader who pastes them in order would), with ``__name__`` set to
``"docs_example"`` so that ``if __name__ == "__main__":`` guards define a script's ``main`` without running
it. The working directory is a fresh temporary folder. An HTML comment right above the fence (blank lines
may stand between; several comments may stack) changes what happens to the block; mkdocs renders none of it:

``<!-- docs-test: skip (reason) -->``
    The block is not run. The reason is required, and the number of skipped blocks per page may not grow
    past ``ALLOWED_SKIPS`` below: a new skip needs a reason written here too.
``<!-- docs-test: excerpt path/to/file.py -->``
    The block quotes library code: it must appear in that file, line for line (indentation and blank lines
    aside), so the docs show what the code does.
``<!-- docs-test: setup ... -->``
    Hidden code run before the block, for a snippet that uses names the reader has already (their own reward
    function, say). It spans lines: everything between ``setup`` and ``-->``.
``<!-- docs-test: replace OLD => NEW -->``
    Run the block with the text ``OLD`` replaced by ``NEW`` (``OLD`` must occur): for the values a script's
    prose tells a reader to change to try it on the demo model (its 256 positions need short prompts and
    responses), never to hide a broken line.
``<!-- docs-test: run -->``
    The block is a script: besides running for its definitions, it runs as ``__main__`` in a fresh
    interpreter (after the page's earlier blocks, as definitions), for one training step, on 1 process. The
    docs keep the values a user would pick (``devices=2``, ``max_steps=100``); the fixture applied in that
    interpreter (``_docs_fixture``) sets ``Trainer(devices=1, max_steps=1)``, ``RLHFStrategy(rollout="hf")``
    (one vLLM engine per fit would pile up in the one interpreter all ``run`` blocks share; tests/vllm covers
    vLLM), turns the model summary off and points ``prepare_demo_model`` (and ``prepare_tool_model``) at the
    session's cached demo model (and tool model).
    Each run must end with ``global_step == 1``.

The hub ids in ``MODEL_STANDINS`` (a page's example model) are replaced in the code by the demo model's local
folder: nothing is downloaded, and the block runs with a real (tiny) model. ``lightning-rlhf/tiny-addition``, the
embedded demo model's name, needs no stand-in: ``LIGHTNING_RLHF_CACHE`` points at the session's cache, where the
``demo_model`` fixture has built it. Prefer that name in new examples: a reader can run them as they are.
"""

from __future__ import annotations

import builtins
import io
import json
import linecache
import os
import re
import subprocess
import sys
import textwrap
import time
import tokenize
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, failure_text

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: Skipped blocks allowed per page, each with its reason. Make a block run rather than add one here.
ALLOWED_SKIPS: dict[str, list[str]] = {
    "docs/cli.md": ["loads the folder that `lightning-rlhf export` writes from a 200-step run"],
    "docs/hybrid-engine.md": ["a Trainer on 8 GPUs"],
}

#: Blocks of pages this suite's authors may not edit (README.md belongs to the lead): the directive a comment
#: above the block would give, keyed by a line the block contains. An inline comment takes precedence.
EXTERNAL_DIRECTIVES: dict[str, list[tuple[str, str]]] = {}

#: Model ids replaced by the demo model's local folder in the code that runs.
MODEL_STANDINS = ("Qwen/Qwen2.5-0.5B-Instruct",)

_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(?P<kind>[\w-]+)(?P<arg>.*?)-->", re.DOTALL)
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")


@dataclass
class Block:
    """One fenced ``python`` block of a page and the directives above it."""

    page: str
    line: int  # 1-based line of the opening fence
    code: str
    directives: list[tuple[str, str]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"

    def directive(self, kind: str) -> str | None:
        return next((arg for k, arg in self.directives if k == kind), None)

    def runnable_code(self, model: str) -> str:
        """The code that runs: the ``replace`` directives applied, the model stand-ins put in."""
        code = self.code
        for kind, arg in self.directives:
            if kind == "replace":
                old, new = arg.split(" => ")
                if old not in code:
                    raise ValueError(f"{self.label}: `docs-test: replace {arg}`: {old!r} is not in the block.")
                code = code.replace(old, new)
        return with_standins(code, model)


def parse_directive(text: str, where: str) -> tuple[str, str]:
    """``(kind, argument)`` of one ``<!-- docs-test: ... -->`` comment; raises on a malformed one."""
    m = _DIRECTIVE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{where}: malformed docs-test comment {text!r}. HINT: `<!-- docs-test: KIND ARG -->`.")
    kind, arg = m["kind"], m["arg"].strip() if m["kind"] != "setup" else textwrap.dedent(m["arg"]).strip("\n")
    if kind == "skip" and not re.fullmatch(r"\(.+\)", arg, re.DOTALL):
        raise ValueError(f"{where}: `docs-test: skip` needs a reason. HINT: `<!-- docs-test: skip (why) -->`.")
    if kind == "excerpt" and not (ROOT / arg).is_file():
        raise ValueError(f"{where}: `docs-test: excerpt {arg}`: no such file under {ROOT}.")
    if kind == "run" and arg:
        raise ValueError(f"{where}: `docs-test: run` takes no argument (got {arg!r}).")
    if kind == "replace" and len(arg.split(" => ")) != 2:
        raise ValueError(f"{where}: `docs-test: replace` takes `OLD => NEW` (got {arg!r}).")
    if kind not in ("skip", "excerpt", "setup", "replace", "run"):
        raise ValueError(f"{where}: unknown docs-test directive {kind!r}. Valid: skip, excerpt, setup, replace, run.")
    return kind, arg


def extract_blocks(text: str, page: str) -> list[Block]:
    """The ``python`` blocks of a Markdown page, with their directives. A directive must stand right above a
    ``python`` fence (blank lines and other directives between are fine); anywhere else it raises."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("<!-- docs-test:"):
            start = i
            while "-->" not in lines[i]:
                i += 1
                if i == len(lines):
                    raise ValueError(f"{page}:{start + 1}: unterminated docs-test comment.")
            pending.append(parse_directive("\n".join(lines[start : i + 1]), f"{page}:{start + 1}"))
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            start, indent = i, len(fence["indent"])
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            body = "\n".join(row[indent:] if row[:indent].isspace() else row for row in lines[start + 1 : i])
            if fence["lang"] in ("python", "py"):
                blocks.append(Block(page, start + 1, textwrap.dedent(body) + "\n", pending))
            elif pending:
                raise ValueError(f"{page}:{start + 1}: docs-test comment above a {fence['lang'] or 'plain'} block.")
            pending = []
        elif line.strip() and pending:
            raise ValueError(f"{page}:{i + 1}: a docs-test comment must stand right above a ```python block.")
        i += 1
    if pending:
        raise ValueError(f"{page}: docs-test comment at the end of the page, above no block.")
    for needle, directive in EXTERNAL_DIRECTIVES.get(page, []):
        for block in blocks:
            if needle in block.code and not block.directives:
                block.directives = [parse_directive(f"<!-- docs-test: {directive} -->", block.label)]
    return blocks


def page_blocks() -> dict[str, list[Block]]:
    """Every page's python blocks, keyed by the page's path relative to the repository."""
    out = {}
    for path in PAGES:
        name = path.relative_to(ROOT).as_posix()
        out[name] = extract_blocks(path.read_text(encoding="utf-8"), name)
    return out


BLOCKS = page_blocks()
RUN_BLOCKS = [b for blocks in BLOCKS.values() for b in blocks if b.directive("run") is not None]


def with_standins(code: str, model: str) -> str:
    """The code with every id of ``MODEL_STANDINS`` (as a string literal) replaced by ``model``."""
    for name in MODEL_STANDINS:
        code = code.replace(f'"{name}"', repr(model)).replace(f"'{name}'", repr(model))
    return code


def _compile(code: str, filename: str) -> Any:
    # Registered with linecache so that a traceback shows the docs' own lines.
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    return compile(code, filename, "exec")


def exec_block(block: Block, namespace: dict[str, Any], model: str, *, name: str = "docs_example") -> None:
    """Run one block (its hidden setup first) in ``namespace``, as module ``name``."""
    namespace["__name__"] = name
    setup = block.directive("setup")
    if setup:
        exec(_compile(with_standins(setup + "\n", model), f"<{block.label} setup>"), namespace)
    exec(_compile(block.runnable_code(model), f"<{block.label}>"), namespace)


def logical_lines(text: str, where: str) -> list[str]:
    """The code's logical lines as token strings: comments, docstrings, indentation and line breaks inside
    brackets dropped, so an excerpt may trim comments and docstrings and wrap lines differently."""
    out: list[str] = []
    current: list[tokenize.TokenInfo] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in _LAYOUT:
                continue
            if tok.type != tokenize.NEWLINE:
                current.append(tok)
                continue
            if current and any(t.type != tokenize.STRING for t in current):  # a bare string is a docstring
                out.append(" ".join(t.string for t in current))
            current = []
    except (tokenize.TokenError, IndentationError) as err:
        pytest.fail(f"{where}: cannot tokenize: {err}")
    if current:
        out.append(" ".join(t.string for t in current))
    return out


_LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING}


def check_excerpt(block: Block) -> None:
    """The block's logical lines appear in a row in the file its ``excerpt`` directive names."""
    path = block.directive("excerpt")
    assert path is not None
    want = logical_lines(block.code, block.label)
    have = logical_lines((ROOT / path).read_text(encoding="utf-8"), path)
    n = len(want)
    if any(have[s : s + n] == want for s in range(len(have) - n + 1)):
        return

    def agreeing(s: int) -> int:  # how many of the block's first lines match from position s
        return next((k for k in range(n) if s + k >= len(have) or have[s + k] != want[k]), n)

    best = max(range(len(have)), key=agreeing, default=0)
    k = agreeing(best)
    where = f"after its first {k} lines" if k else "from its first line"
    code = have[best + k] if k and best + k < len(have) else "(no such line)"
    pytest.fail(
        f"{block.label}: the block no longer matches {path} {where}.\n  docs: {want[k]}\n  code: {code}\n"
        "HINT: copy the current code into the docs (comments and docstrings may be left out)."
    )


# ---------------------------------------------------------------------------------------------- the pages
def _registries() -> tuple[Any, ...]:
    from lightning_rlhf.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES

    return ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES


def _restore_registries(before: list[dict[str, Any]]) -> None:
    """Remove the names registered since ``before`` (the registry has no public way to unregister)."""
    for registry, entries in zip(_registries(), before, strict=True):
        registry._entries.clear()
        registry._entries.update(entries)


@pytest.fixture()
def registries_restored() -> Any:
    """Names a page registers (a new advantage estimator, ...) are removed again after it."""
    before = [dict(r._entries) for r in _registries()]
    yield
    _restore_registries(before)


@pytest.mark.parametrize("page", [p for p, blocks in BLOCKS.items() if blocks])
def test_page_examples_run(
    page: str, demo_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registries_restored: None
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_RLHF_CACHE", str(Path(demo_model).parent))
    namespace: dict[str, Any] = {"__builtins__": builtins}
    for block in BLOCKS[page]:
        if block.directive("skip") is not None:
            continue
        if block.directive("excerpt") is not None:
            check_excerpt(block)
            continue
        exec_block(block, namespace, demo_model)


def test_skips_are_few_and_explained() -> None:
    skipped = Counter(b.page for blocks in BLOCKS.values() for b in blocks if b.directive("skip") is not None)
    grown = {page: n for page, n in skipped.items() if n > len(ALLOWED_SKIPS.get(page, []))}
    assert not grown, (
        f"more skipped docs blocks than ALLOWED_SKIPS lists: {grown}. HINT: make the block run (see this module's "
        "docstring: `setup`, `run`, the model stand-ins), or list the skip and its reason in ALLOWED_SKIPS."
    )
    total = sum(len(b) for b in BLOCKS.values())
    assert total >= 30 and sum(skipped.values()) <= 5, (total, skipped)


# ------------------------------------------------------------------------------------- scripts, one step
def _docs_fixture(cache_dir: str, fits: list[int], tool_model: str) -> None:
    """What the ``run`` blocks' interpreter applies before them: 1 process, 1 step, the transformers rollout
    engine (one vLLM engine per fit in one interpreter is what this fixture must avoid; tests/vllm runs vLLM),
    no model summary, the session's demo model, and the session's tool model for ``lightning-rlhf/tiny-tools``
    (its short warm start: the full one would add a minute). Appends each ``fit``'s final ``global_step`` to
    ``fits``."""
    import lightning.pytorch as pl

    import lightning_rlhf
    import lightning_rlhf.demo as demo
    from lightning_rlhf.demo import warmstart

    init, fit, strategy_init = pl.Trainer.__init__, pl.Trainer.fit, lightning_rlhf.RLHFStrategy.__init__

    def patched_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.update(devices=1, max_steps=1, enable_model_summary=False)
        kwargs.pop("max_epochs", None)
        init(self, *args, **kwargs)

    def patched_fit(self: Any, *args: Any, **kwargs: Any) -> None:
        fit(self, *args, **kwargs)
        fits.append(self.global_step)

    def patched_strategy_init(self: Any, rollout: str = "auto", **kwargs: Any) -> None:
        strategy_init(self, "hf", **kwargs)

    prepare = warmstart.prepare_demo_model

    def cached_demo_model(cache: str, **kwargs: Any) -> str:
        del cache  # the docs' own folder (/tmp/lr-cache, ~/.cache/...): use the session's
        return prepare(cache_dir, **kwargs)

    pl.Trainer.__init__ = patched_init  # type: ignore[method-assign]
    pl.Trainer.fit = patched_fit  # type: ignore[method-assign]
    lightning_rlhf.RLHFStrategy.__init__ = patched_strategy_init  # type: ignore[method-assign]
    demo.prepare_demo_model = warmstart.prepare_demo_model = cached_demo_model  # type: ignore[assignment]
    warmstart.prepare_tool_model = lambda cache, **kwargs: tool_model  # type: ignore[assignment]


def run_blocks_main() -> None:
    """Entry point of the ``run`` blocks' interpreter. ``argv[1]``: a JSON file with the session's cache folder
    and, per ``run`` block, its label and the codes to run (its page's earlier blocks, then itself as
    ``__main__``); ``argv[2]``: where to write, per label, the ``global_step`` of each fit and any error."""
    import traceback

    spec = json.loads(Path(sys.argv[1]).read_text())
    fits: list[int] = []
    _docs_fixture(spec["cache_dir"], fits, spec["tool_model"])
    results = {}
    registered = [dict(r._entries) for r in _registries()]
    for script in spec["scripts"]:
        _restore_registries(registered)  # each script registers its page's names anew
        fits.clear()
        started = time.perf_counter()
        namespace: dict[str, Any] = {"__builtins__": builtins}
        error = None
        try:
            for i, (label, code) in enumerate(script["codes"]):
                namespace["__name__"] = "__main__" if i == len(script["codes"]) - 1 else "docs_example"
                exec(_compile(code, f"<{label}>"), namespace)
        except BaseException:
            error = traceback.format_exc()
        took = time.perf_counter() - started
        results[script["label"]] = {"fits": list(fits), "error": error, "seconds": round(took, 1)}
        print(f"docs-test run {script['label']}: fits {fits}, {'failed' if error else 'ok'}, {took:.1f} s", flush=True)
    Path(sys.argv[2]).write_text(json.dumps(results))


def _script_codes(block: Block, model: str) -> list[tuple[str, str]]:
    """The codes a ``run`` block's script is: its page's earlier runnable blocks, then itself."""
    page = BLOCKS[block.page]
    codes = []
    for b in [*page[: page.index(block)], block]:
        if b.directive("skip") is not None or b.directive("excerpt") is not None:
            continue
        setup = b.directive("setup")
        codes += [(f"{b.label} setup", with_standins(setup + "\n", model))] if setup else []
        codes.append((b.label, b.runnable_code(model)))
    return codes


_RUNNER = "from tests.unit.test_docs_examples import run_blocks_main; run_blocks_main()"


@pytest.fixture(scope="module")
def script_runs(
    demo_model: str, tool_model: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], str]:
    """Runs every ``run`` block, one after another, in one fresh interpreter (its imports cost more than the
    steps); returns the results per label and the interpreter's output."""
    folder = tmp_path_factory.mktemp("docs_scripts")
    scripts = [{"label": b.label, "codes": _script_codes(b, demo_model)} for b in RUN_BLOCKS]
    spec = {"scripts": scripts, "cache_dir": str(Path(demo_model).parent), "tool_model": tool_model}
    (folder / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "LIGHTNING_RLHF_CACHE": str(Path(demo_model).parent),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(folder / "spec.json"), str(folder / "results.json")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(folder),
        env=env,
    )
    assert proc.returncode == 0 and (folder / "results.json").exists(), failure_text(proc)
    return json.loads((folder / "results.json").read_text()), proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.label for b in RUN_BLOCKS])
def test_script_trains_one_step(block: Block, script_runs: tuple[dict[str, Any], str]) -> None:
    results, output = script_runs
    result = results[block.label]
    assert result["error"] is None, f"{block.label} failed:\n{result['error']}"
    assert result["fits"] == [1], f"{block.label}: expected one fit of one step, got {result['fits']}\n{output[-3000:]}"


# ------------------------------------------------------------------------------------ the convention itself
def test_directives_are_parsed_and_checked() -> None:
    page = textwrap.dedent(
        """\
        <!-- docs-test: skip (needs a GPU) -->

        ```python
        x = 1
        ```

        - a list item:

          ```python
          y = 2
          ```

        <!-- docs-test: setup
        def mine(prompts, completions, **kw):
            return [0.0] * len(completions)
        -->
        <!-- docs-test: run -->
        ```python
        z = mine([], [])
        ```
        """
    )
    a, b, c = extract_blocks(page, "p.md")
    assert (a.line, a.directives) == (3, [("skip", "(needs a GPU)")])
    assert (b.code, b.directives) == ("y = 2\n", [])
    assert c.directive("run") == "" and c.directive("setup") is not None
    namespace: dict[str, Any] = {}
    exec_block(c, namespace, "unused")
    assert namespace["z"] == []

    for bad, message in [
        ("<!-- docs-test: skip -->\n```python\nx\n```\n", "needs a reason"),
        ("<!-- docs-test: sikp (x) -->\n```python\nx\n```\n", "unknown docs-test directive 'sikp'"),
        ("<!-- docs-test: skip (x) -->\nprose\n```python\nx\n```\n", "must stand right above"),
        ("<!-- docs-test: skip (x) -->\n```bash\nls\n```\n", "above a bash block"),
        ("<!-- docs-test: excerpt no/such.py -->\n```python\nx\n```\n", "no such file"),
        ("<!-- docs-test: replace a -> b -->\n```python\nx\n```\n", "takes `OLD => NEW`"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            extract_blocks(bad, "p.md")


def test_replace_changes_the_code_that_runs() -> None:
    code = 'run(steps=100, "Qwen/Qwen2.5-0.5B-Instruct")'
    page = f"<!-- docs-test: replace steps=100 => steps=1 -->\n```python\n{code}\n```\n"
    (block,) = extract_blocks(page, "p.md")
    assert block.runnable_code("/m") == "run(steps=1, '/m')\n"
    stale = extract_blocks(page.replace("steps=100,", "steps=5,"), "p.md")[0]
    with pytest.raises(ValueError, match="'steps=100' is not in the block"):
        stale.runnable_code("/m")


def test_an_excerpt_that_drifted_fails() -> None:
    code = "def compute_advantages(self, rollout):\n    return 42\n"
    block = Block("p.md", 1, code, [("excerpt", "tests/conftest.py")])
    with pytest.raises(pytest.fail.Exception, match=r"no longer matches tests/conftest\.py from its first line"):
        check_excerpt(block)
    good = Block("p.md", 1, "def failure_text(proc: subprocess.CompletedProcess[str]) -> str:\n", block.directives)
    check_excerpt(good)


def test_standins_replace_only_listed_model_ids() -> None:
    code = 'GRPOModule("Qwen/Qwen2.5-0.5B-Instruct")\nload("openai/gsm8k")\ny = \'Qwen/Qwen2.5-0.5B-Instruct\'\n'
    assert with_standins(code, "/m") == "GRPOModule('/m')\nload(\"openai/gsm8k\")\ny = '/m'\n"
