"""The docs site's structure: every page is reachable, the pages a newcomer and a migrating user need are linked,
the user pages say what is true now (journals live in the logs), and CHANGELOG.md is a list per version.

``mkdocs build --strict`` fails on a broken link but only prints an INFO line for a page that no nav entry reaches,
so that check is here, with the ones no build makes.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT

DOCS = ROOT / "docs"

#: Pages that are records by date (a measurement or an investigation each): commit hashes and dates belong here.
LOGS = {"performance-log.md", "placement-log.md", "soak-log.md", "faults-log.md"}

_ISSUE = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)
#: A commit hash as the docs wrote them: 7 to 12 lowercase hex digits, at least one letter and one digit.
_HASH = re.compile(r"(?<![\w/.#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![\w-])")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _nav_pages(node: Any) -> list[str]:
    """The ``.md`` paths a mkdocs ``nav`` (nested lists of strings and one-key mappings) names."""
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def _mkdocs() -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert isinstance(config, dict)
    return config


def _site_pages() -> set[str]:
    """Every page mkdocs builds: the ``.md`` files under docs/ outside ``exclude_docs``."""
    excluded = [line.strip().rstrip("/") for line in _mkdocs().get("exclude_docs", "").splitlines() if line.strip()]
    pages = set()
    for path in DOCS.rglob("*.md"):
        rel = path.relative_to(DOCS).as_posix()
        if not any(rel == ex or rel.startswith(ex + "/") for ex in excluded):
            pages.add(rel)
    return pages


def _links(page: str) -> set[str]:
    """The relative targets (without anchors) of a docs page's markdown links, resolved from docs/."""
    base = (DOCS / page).parent
    text = (DOCS / page).read_text()
    return {
        (base / target).resolve().relative_to(DOCS.resolve()).as_posix()
        for target in _LINK.findall(text)
        if "://" not in target
    }


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    nav = _nav_pages(_mkdocs()["nav"])
    pages = _site_pages()
    unreachable = sorted(pages - set(nav))
    assert not unreachable, (
        f"docs pages no mkdocs.yml nav entry reaches (mkdocs only prints an INFO line for these): {unreachable}. "
        "HINT: add each under the nav section it belongs to (a log under 'Measurement logs')."
    )
    missing = sorted(set(nav) - pages)
    assert not missing, f"mkdocs.yml nav names pages that do not exist: {missing}"
    assert len(nav) == len(set(nav)), f"a page is in the nav twice: {sorted(p for p in nav if nav.count(p) > 1)}"


@pytest.mark.parametrize(
    ("page", "targets"),
    [
        ("index.md", {"agents.md", "lora.md", "moving-from-verl-trl.md", "api/index.md"}),
        ("performance.md", {"performance-log.md"}),
        ("faults.md", {"faults-log.md"}),
        ("moving-from-verl-trl.md", {"agents.md", "lora.md", "data.md"}),
        ("api/index.md", {"api/agents.md"}),
    ],
)
def test_pages_link_the_guides_a_reader_needs(page: str, targets: set[str]) -> None:
    missing = sorted(targets - _links(page))
    assert not missing, f"docs/{page} does not link {missing}"


def test_api_reference_has_the_agents_package() -> None:
    import lightning_rlhf.agents

    page = (DOCS / "api" / "agents.md").read_text()
    documented = set(re.findall(r"^::: lightning_rlhf\.agents\.(\w+)\s*$", page, re.MULTILINE))
    missing = sorted(set(lightning_rlhf.agents.__all__) - documented)
    assert not missing, (
        f"docs/api/agents.md has no entry for {missing} (in lightning_rlhf.agents.__all__). "
        "HINT: add `::: lightning_rlhf.agents.NAME` for each."
    )


def _package_has(pattern: str) -> bool:
    regex = re.compile(pattern)
    return any(regex.search(path.read_text()) for path in (ROOT / "lightning_rlhf").rglob("*.py"))


#: Migration keys whose row must say "not yet" exactly while the package has no such feature (the regex: what
#: an implementation of it would have to name). When one lands the row must change: this test fails until it does.
NOT_YET: dict[str, str] = {
    "gradient_checkpointing": r"gradient_checkpointing|checkpoint_wrapper|activation_checkpointing",
    "enable_gradient_checkpointing": r"gradient_checkpointing|checkpoint_wrapper|activation_checkpointing",
    "param_offload": r"param_offload|offload_param|OffloadPolicy",
}

#: Keys a TRL or verl user looks for, and the page their row must link where the feature is.
MIGRATION_KEYS: dict[str, str | None] = {
    "peft_config": "lora.md",
    "tools": "agents.md",
    "environment_factory": "agents.md",
    "chat_template_kwargs": "data.md",
    "gradient_checkpointing": "performance.md",
    "steps_per_generation": None,
    "lora_rank": "lora.md",
    "multi_turn": "agents.md",
    "enable_gradient_checkpointing": "performance.md",
    "param_offload": None,
    "ulysses_sequence_parallel_size": "performance.md",
}


def _rows(text: str, key: str) -> list[str]:
    """Table rows whose first cell names ``key`` in backticks, alone or as one part of a dotted key
    (``rollout.multi_turn.enable``), optionally with a value (``peft_config=LoraConfig(...)``)."""
    cell = re.compile(rf"^\|[^|]*`(?:[\w.]*\.)?{re.escape(key)}(?:\.[\w.]+)?(?:[=(][^`]*)?`")
    return [line for line in text.splitlines() if cell.match(line)]


@pytest.mark.parametrize("key", sorted(MIGRATION_KEYS))
def test_migration_page_has_a_row_per_key(key: str) -> None:
    rows = _rows((DOCS / "moving-from-verl-trl.md").read_text(), key)
    assert rows, f"docs/moving-from-verl-trl.md has no table row whose first cell names `{key}`"
    text = " ".join(rows)
    if key in NOT_YET:
        there = _package_has(NOT_YET[key])
        says_not_yet = "not yet" in text.lower()
        assert says_not_yet != there, (
            f"docs/moving-from-verl-trl.md's `{key}` row {'says' if says_not_yet else 'does not say'} 'not yet' "
            f"while lightning_rlhf {'has' if there else 'has no'} code matching {NOT_YET[key]!r}. "
            "HINT: write the row for what the package does now."
        )
    page = MIGRATION_KEYS[key]
    if page is not None:
        assert f"]({page}" in text, f"docs/moving-from-verl-trl.md's `{key}` row does not link {page}"


def _journal_marks(text: str) -> list[str]:
    return _ISSUE.findall(text) + _HASH.findall(text)


def test_the_journal_check_finds_what_it_should() -> None:
    assert _journal_marks("measured before (commit dc001d4) and after (issue 32)") == ["issue 32", "dc001d4"]
    assert _journal_marks("a 7B model, 1024 GPUs, `runs/x/20261127-044035`, ckpt.tmp-<token>, 0x1f2e3d4c") == []


def test_user_pages_hold_no_journal() -> None:
    """Internal issue numbers and commit hashes mean nothing to a reader: a user page says what is true now and
    how to reproduce it; the dated record of how it got there is in the logs."""
    found = {}
    for page in sorted(_site_pages() - LOGS):
        marks = _journal_marks((DOCS / page).read_text())
        if marks:
            found[page] = marks
    assert not found, (
        f"internal issue numbers or commit hashes on user pages: {found}. HINT: move the history to a log "
        f"({sorted(LOGS)}) and say on the page what holds now."
    )


def _version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_changelog_is_a_short_list_per_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert versions[:2] == ["Unreleased", _version()], (
        f"CHANGELOG.md's versions are {versions}; expected '## [Unreleased]' first, then '## [{_version()}]' "
        "(pyproject.toml's version)"
    )
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    for section in sections:
        name = section.splitlines()[0]
        headings = re.findall(r"^### (\w+)", section, re.MULTILINE)
        assert set(headings) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, (name, headings)
        if name.startswith(("[Unreleased]", f"[{_version()}]")):
            assert {"Added", "Changed", "Fixed"} <= set(headings), (name, headings)
    marks = _journal_marks(text)
    assert not marks, f"CHANGELOG.md names internal issues or commits, which no reader can resolve: {marks}"
