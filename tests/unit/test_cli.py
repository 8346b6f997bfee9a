"""The command line parses recipes into the real classes and rejects bad keys before any model loads."""

from __future__ import annotations

import pytest
import torch

from lightning_rlhf import GRPOModule, PPOModule, RLHFStrategy, RolloutConfig
from lightning_rlhf.callbacks import ExportActor
from lightning_rlhf.cli import RLHFCLI, setting_names
from tests.conftest import ROOT

DEMO = str(ROOT / "recipes" / "demo.yaml")


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["lightning-rlhf"])  # LightningCLI warns when sys.argv has arguments too


def build(*args: str) -> RLHFCLI:
    """Parse and instantiate (module, data, trainer) without running: only the tokenizer loads."""
    return RLHFCLI(["--config", DEMO, *args], run=False)


def parse_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        RLHFCLI(["fit", "--config", DEMO, *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_recipe_builds_the_module_strategy_and_export_callback(tiny_model: str) -> None:
    cli = build("--model.actor", tiny_model, "--model.rollout.n", "4", "--trainer.strategy.param_dtype", "bfloat16")
    assert isinstance(cli.model, GRPOModule)
    assert cli.model.rollout_config == RolloutConfig(n=4, temperature=1.0, max_new_tokens=6)  # YAML + override
    assert cli.model.algorithm.batching.micro_batch_size == 128 and cli.model.algorithm.kl.coef == 0.0
    strategy = cli.trainer.strategy
    assert isinstance(strategy, RLHFStrategy) and strategy.param_dtype == torch.bfloat16
    assert any(isinstance(c, ExportActor) for c in cli.trainer.callbacks)  # type: ignore[attr-defined]
    assert cli.trainer.log_every_n_steps == 1


@pytest.mark.parametrize(
    ("class_path", "check"),
    [
        ("lightning_rlhf.GRPOModule", lambda m: m.algorithm.kl.coef == 0.001 and m.reference is not None),
        ("lightning_rlhf.PPOModule", lambda m: m.algorithm.advantage == "gae" and m.rollout_config.n == 1),
        ("lightning_rlhf.DAPOModule", lambda m: m.algorithm.filtering.dynamic_sampling and m.rollout_config.n == 16),
        ("lightning_rlhf.RLOOModule", lambda m: m.algorithm.advantage == "rloo"),
    ],
)
def test_unset_settings_keep_each_modules_own_defaults(tiny_model: str, class_path: str, check) -> None:
    # The command line passes every argument, unset ones as None: a module's defaults must survive that.
    args = ["--model", class_path, "--model.actor", tiny_model, "--model.reward", "lightning_rlhf.demo.addition_reward"]
    if class_path.endswith("PPOModule"):
        args += ["--model.critic", tiny_model]
    cli = RLHFCLI(["--data.train", str(ROOT / "recipes" / "data" / "addition.jsonl"), *args], run=False)
    assert isinstance(cli.trainer.strategy, RLHFStrategy)  # the default: recipes need not name it
    assert check(cli.model)
    assert isinstance(cli.model, GRPOModule | PPOModule)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.rollout.max_new_token", "3"], "unknown key 'model.rollout.max_new_token': RolloutConfig has no "
         "setting 'max_new_token'. Did you mean 'model.rollout.max_new_tokens'?"),
        (["--model.rolout.n", "3"], "GRPOModule has no setting 'rolout'. Did you mean 'model.rollout.n'?"),
        (["--trainer.max_step", "3"], "unknown key 'trainer.max_step'. Did you mean 'trainer.max_steps'?"),
        (["--trainer.strategy.rolout", "hf"], "RLHFStrategy has no setting 'rolout'. Did you mean "
         "'trainer.strategy.rollout'?"),
        (["--data.batchsize", "4"], "PromptDataModule has no setting 'batchsize'. Did you mean 'data.batch_size'?"),
        (["--model.actor_optim.lrr", "1"], "OptimConfig has no setting 'lrr'. Did you mean 'model.actor_optim.lr'?"),
    ],
)  # fmt: skip
def test_unknown_key_names_it_and_the_closest_valid_one(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    # The error comes while parsing, before any model (the recipe's embedded one included) is resolved.
    assert expected in parse_error(capsys, *args)


def test_unknown_key_in_a_recipe_file(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("model:\n  init_args:\n    algorithm:\n      kl_coeff: 0.1\n")
    message = parse_error(capsys, "--config", str(recipe))
    assert "AlgorithmConfig has no setting 'kl_coeff'. Did you mean 'model.algorithm.kl.coef'?" in message


def test_bad_values_are_one_line_errors(capsys: pytest.CaptureFixture[str], tiny_model: str) -> None:
    message = parse_error(capsys, "--model.actor", tiny_model, "--model.algorithm.advantage", "nope")
    assert message.startswith("error: AlgorithmConfig.advantage='nope' is invalid: expected one of [")
    message = parse_error(capsys, "--trainer.strategy.param_dtype", "bfloat1")
    assert message == (
        "error: RLHFStrategy.param_dtype='bfloat1' is not a dtype lightning_rlhf computes in. "
        "HINT: 'float32' or 'bfloat16'."
    )
    message = parse_error(capsys, "--model.actor", tiny_model, "--trainer.strategy.vllm", "{tensor_parallel: 2}")
    assert message == "error: VLLMConfig has no setting 'tensor_parallel'. Did you mean 'tensor_parallel_size'?"


def test_reward_import_path_that_does_not_import(capsys: pytest.CaptureFixture[str], tiny_model: str) -> None:
    message = parse_error(capsys, "--model.actor", tiny_model, "--model.reward", "lightning_rlhf.demo.no_such_fn")
    assert "model.init_args.reward='lightning_rlhf.demo.no_such_fn' is neither a local model folder nor an " in message
    assert "AttributeError" in message


def test_setting_names_follow_kwargs_to_the_parent() -> None:
    names = setting_names(GRPOModule)
    assert names[:3] == ["actor", "reward", "critic"] and "algorithm" in names
    assert setting_names(RolloutConfig)[:2] == ["n", "temperature"]
