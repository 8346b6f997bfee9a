"""The recipes' data and headers: a recipe's held-out prompts are held out (none is in its training file, and the
demo's are the demo's own split), and every recipe header says where its run folder goes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("**/*.yaml"))


def prompts(path: Path) -> set[str]:
    return {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()}


def data_of(recipe: Path) -> dict[str, str]:
    return yaml.safe_load(recipe.read_text())["data"]["init_args"]


@pytest.mark.parametrize("recipe", ["grpo_lora", "sft_demo", "agent_tools"])
def test_a_recipes_held_out_prompts_are_not_in_its_training_file(recipe: str) -> None:
    data = data_of(ROOT / "recipes" / f"{recipe}.yaml")
    train, val = prompts(ROOT / data["train"]), prompts(ROOT / data["val"])
    assert train and val and not train & val, sorted(train & val)[:5]


def test_the_lora_recipe_holds_out_the_demos_own_split() -> None:
    """The same 20 sums the warm start of `lightning-rlhf/tiny-addition` and the demo leave out."""
    from lightning_rlhf.demo.task import addition_splits

    data = data_of(ROOT / "recipes" / "grpo_lora.yaml")
    splits = addition_splits()
    assert prompts(ROOT / data["val"]) == set(splits["test"]["prompt"])
    assert prompts(ROOT / data["train"]) == set(splits["train"]["prompt"])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_every_recipe_header_says_where_its_run_folder_goes(recipe: Path) -> None:
    text = recipe.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    logger = yaml.safe_load(text)["trainer"]["logger"]["init_args"]
    folder = f"{logger['save_dir']}/{logger.get('name', 'lightning_logs')}/"
    assert re.search(rf"# Output: {re.escape(folder)} .* under the folder you run it from", header), folder
    assert "--trainer.logger.save_dir" in header
