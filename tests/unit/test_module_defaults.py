"""A passed ``algorithm`` is merged over a ready module's own: the variant's defining choices survive it, and a
choice that contradicts them is refused before any model loads."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from lightning_rlhf import (
    AlgorithmConfig,
    BatchingConfig,
    DAPOModule,
    DrGRPOModule,
    GRPOModule,
    KLConfig,
    LossConfig,
    PPOModule,
    REINFORCEPPModule,
    ReMaxModule,
    RLOOModule,
    RolloutConfig,
    SafeRLHFModule,
)
from lightning_rlhf.demo import addition_cost, addition_reward
from lightning_rlhf.modules.defaults import set_fields

# module, extra arguments, the settings that define it by path (kept under a user's micro_batch_size=4), and a
# choice that contradicts them (a group given as a dict) with the words of its refusal.
CASES: list[tuple[type, dict[str, Any], dict[str, Any], dict[str, Any], str]] = [
    (
        GRPOModule,
        {},
        {"advantage": "grpo", "norm_adv_by_std": True, "kl.estimator": "k3"},
        {"advantage": "gae"},
        r"GRPOModule: AlgorithmConfig.advantage='gae' contradicts .* HINT: use PPOModule\(critic=...\) for 'gae'",
    ),
    (
        RLOOModule,
        {},
        {"advantage": "rloo"},
        {"advantage": "reinforce_plus_plus"},
        r"RLOOModule: AlgorithmConfig.advantage='reinforce_plus_plus' contradicts .* needs advantage: 'rloo'",
    ),
    (
        REINFORCEPPModule,
        {"reference": True},
        {"advantage": "reinforce_plus_plus", "kl.in_reward": True, "kl.estimator": "k2"},
        {"advantage": "rloo"},
        r"REINFORCEPPModule: AlgorithmConfig.advantage='rloo' contradicts .* 'reinforce_plus_plus'",
    ),
    (
        DrGRPOModule,
        {},
        {"advantage": "grpo", "norm_adv_by_std": False, "loss.loss_agg": "seq-mean-token-sum-norm"},
        {"loss": {"loss_agg": "seq-mean-token-mean"}},
        r"DrGRPOModule: AlgorithmConfig.loss.loss_agg='seq-mean-token-mean' contradicts the module's algorithm, "
        r"which needs loss.loss_agg: 'seq-mean-token-sum-norm'; left unset it is 'seq-mean-token-sum-norm'. "
        r"HINT: use GRPOModule",
    ),
    (
        DAPOModule,
        {"rollout": RolloutConfig(n=4, max_new_tokens=8)},
        {
            "advantage": "grpo",
            "loss.clip_ratio_high": 0.28,
            "loss.loss_agg": "token-mean",
            "filtering.dynamic_sampling": True,
            "kl.coef": 0.0,
        },
        {"loss": {"clip_ratio_low": 0.3}},
        r"DAPOModule: AlgorithmConfig.loss.clip_ratio_high=0.28 contradicts .* "
        r"above loss.clip_ratio_low \(clip-higher\)",
    ),
    (
        PPOModule,
        {"critic": "<tiny>"},
        {"advantage": "gae", "kl.in_reward": True, "kl.estimator": "k1"},
        {"advantage": "rloo"},
        r"PPOModule: AlgorithmConfig.advantage='rloo' contradicts .* the critic's values \('gae'\)",
    ),
    (
        ReMaxModule,
        {},
        {"advantage": "remax"},
        {"advantage": "rloo"},
        r"ReMaxModule: AlgorithmConfig.advantage='rloo' contradicts .* needs advantage: 'remax'",
    ),
    (
        SafeRLHFModule,
        {"cost": addition_cost},
        {"advantage": "grpo"},
        {"advantage": "remax"},
        r"SafeRLHFModule: AlgorithmConfig.advantage='remax' contradicts .* HINT: use 'gae' \(with critics\)",
    ),
]
IDS = [case[0].__name__ for case in CASES]


def build(cls: type, extra: dict[str, Any], tiny_model: str, **kwargs: Any) -> Any:
    extra = {k: tiny_model if v == "<tiny>" else v for k, v in extra.items()}
    return cls(tiny_model, reward=addition_reward, **extra, **kwargs)


def setting(config: AlgorithmConfig, path: str) -> Any:
    """The setting at ``path`` (``"kl.coef"``) of ``config``."""
    return functools.reduce(getattr, path.split("."), config)


@pytest.mark.parametrize(("cls", "extra", "defining", "conflict", "refusal"), CASES, ids=IDS)
def test_a_passed_algorithm_keeps_the_modules_defining_settings(
    tiny_model: str, cls: type, extra: dict, defining: dict, conflict: dict, refusal: str
) -> None:
    # Before the fix, a passed algorithm replaced the default whole: DrGRPOModule ran plain GRPO.
    module = build(cls, extra, tiny_model, algorithm=AlgorithmConfig(batching=BatchingConfig(micro_batch_size=4)))
    assert {k: setting(module.algorithm, k) for k in defining} == defining
    assert module.algorithm.batching.micro_batch_size == 4  # and the user's own field is kept


@pytest.mark.parametrize(("cls", "extra", "defining", "conflict", "refusal"), CASES, ids=IDS)
def test_a_contradicting_choice_is_refused_before_any_model_loads(
    cls: type, extra: dict, defining: dict, conflict: dict, refusal: str
) -> None:
    # The path does not exist: a refusal that came after loading would name the path instead.
    with pytest.raises(ValueError, match=refusal):
        build(cls, extra, "/nowhere/model", algorithm=AlgorithmConfig(**conflict))


def test_merge_rules() -> None:
    drgrpo = DrGRPOModule.ALGORITHM
    # The default, when nothing is passed; a user's own fields win over the module's where they may.
    assert set_fields(drgrpo.resolve(None)) == {"norm_adv_by_std": False, "loss.loss_agg": "seq-mean-token-sum-norm"}
    mixed = drgrpo.resolve(
        AlgorithmConfig(
            loss=LossConfig(clip_ratio_high=0.3), kl=KLConfig(coef=0.01), batching=BatchingConfig(micro_batch_size=4)
        )
    )
    assert set_fields(mixed) == {
        "norm_adv_by_std": False,
        "loss.loss_agg": "seq-mean-token-sum-norm",
        "batching.micro_batch_size": 4,
        "loss.clip_ratio_high": 0.3,
        "kl.coef": 0.01,
    }
    # kl.coef and filtering.overlong_buffer are the passed config's as given: their default 0 turns the term off.
    grpo = GRPOModule.ALGORITHM
    assert grpo.resolve(None).kl.coef == 0.001 and grpo.resolve(AlgorithmConfig()).kl.coef == 0.0
    dapo = DAPOModule.ALGORITHM
    assert dapo.resolve(None, RolloutConfig(max_new_tokens=40)).filtering.overlong_buffer == 10
    assert dapo.resolve(AlgorithmConfig(), RolloutConfig(max_new_tokens=40)).filtering.overlong_buffer == 0
    assert (
        dapo.resolve(AlgorithmConfig(loss=LossConfig(clip_ratio_high=0.35))).loss.clip_ratio_high == 0.35
    )  # still clip-higher
    # A field set to AlgorithmConfig's own default reads as unset, so it takes the module's value.
    assert ReMaxModule.ALGORITHM.resolve(AlgorithmConfig(advantage="grpo")).advantage == "remax"
    # REINFORCE++: the passed kl.coef, the module's estimator and its place in the reward.
    rpp = REINFORCEPPModule.ALGORITHM.resolve(AlgorithmConfig(kl=KLConfig(coef=0.05)))
    assert (rpp.kl.coef, rpp.kl.estimator, rpp.kl.in_reward) == (0.05, "k2", True)
    with pytest.raises(ValueError, match=r"DrGRPOModule\(algorithm=\{'loss_agg': 'x'\}\) is invalid"):
        drgrpo.resolve({"loss_agg": "x"})  # type: ignore[arg-type]


def test_recipes_and_cli_keep_the_module_settings(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The command line passes every AlgorithmConfig field, unset ones at their defaults: the merge holds there too.
    from lightning_rlhf.cli import RLHFCLI
    from tests.conftest import ROOT

    monkeypatch.setattr("sys.argv", ["lightning-rlhf"])
    args = ["--config", str(ROOT / "recipes" / "demo.yaml"), "--model", "lightning_rlhf.DrGRPOModule"]
    cli = RLHFCLI([*args, "--model.actor", tiny_model, "--model.algorithm.batching.micro_batch_size", "4"], run=False)
    algorithm = cli.model.algorithm
    assert (algorithm.norm_adv_by_std, algorithm.loss.loss_agg, algorithm.batching.micro_batch_size) == (
        False,
        "seq-mean-token-sum-norm",
        4,
    )
    assert algorithm.kl.coef == 0.0 and cli.model.reference is None  # demo.yaml's kl_coef: 0.0 stands


def test_the_command_line_takes_the_flat_spelling_too(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # YAML and flags written before the settings were grouped keep working, with the deprecation naming the new key.
    from lightning_rlhf.cli import RLHFCLI
    from tests.conftest import ROOT

    monkeypatch.setattr("sys.argv", ["lightning-rlhf"])
    args = ["--config", str(ROOT / "recipes" / "demo.yaml"), "--model.actor", tiny_model]
    flat = ["--model.algorithm.kl_estimator", "k1", "--model.rollout.max_turns", "2"]
    with pytest.warns(DeprecationWarning, match=r"Config.(kl_estimator|max_turns) is deprecated: the setting is"):
        cli = RLHFCLI([*args, *flat], run=False)
    assert cli.model.algorithm.kl == KLConfig(coef=0.0, estimator="k1")  # demo.yaml's nested kl.coef kept
    assert cli.model.algorithm.batching.micro_batch_size == 128 and cli.model.rollout_config.episode.max_turns == 2
