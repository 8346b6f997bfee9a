"""RLHFModule and RLHFStrategy reject bad settings before any model weights load."""

from __future__ import annotations

import pytest

from lightning_rlhf import AlgorithmConfig, GRPOModule, KLConfig, PPOModule, RLHFModule, RLHFStrategy
from lightning_rlhf.demo import addition_reward


def test_missing_model_path_names_the_setting(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"RLHFModule\(actor=...\)='/nowhere/model': no such folder"):
        GRPOModule("/nowhere/model", reward=addition_reward)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        GRPOModule(str(tmp_path / "empty"), reward=addition_reward)


def test_missing_critic_and_reward_model_paths(tiny_model: str) -> None:
    with pytest.raises(FileNotFoundError, match=r"RLHFModule\(critic=...\)"):
        PPOModule(tiny_model, reward=addition_reward, critic="./no/critic")
    with pytest.raises(FileNotFoundError, match=r"RLHFModule\(reward=...\)"):
        GRPOModule(tiny_model, reward="./no/reward_model")
    with pytest.raises(TypeError, match="must be a function or a model path"):
        GRPOModule(tiny_model, reward=3)  # type: ignore[arg-type]


def test_inconsistent_roles(tiny_model: str) -> None:
    with pytest.raises(ValueError, match=r"AlgorithmConfig.kl.coef=0.1 needs a reference policy"):
        GRPOModule(
            tiny_model, reward=addition_reward, reference=False, algorithm=AlgorithmConfig(kl=KLConfig(coef=0.1))
        )
    with pytest.raises(ValueError, match=r"advantage='gae' needs a critic"):
        RLHFModule(tiny_model, reward=addition_reward, algorithm=AlgorithmConfig(advantage="gae"))
    with pytest.raises(ValueError, match=r"PPOModule needs a value model"):
        PPOModule(tiny_model, reward=addition_reward)
    with pytest.raises(ValueError, match=r"PPOModule: AlgorithmConfig.advantage='rloo' contradicts"):
        PPOModule(tiny_model, reward=addition_reward, critic=tiny_model, algorithm=AlgorithmConfig(advantage="rloo"))


def test_base_module_without_dataflow_says_what_to_do(tiny_model: str) -> None:
    module = RLHFModule(tiny_model, reward=addition_reward, reference=None)
    with pytest.raises(NotImplementedError, match="subclass RLHFModule"):
        module.training_step(None)  # type: ignore[arg-type]


def test_strategy_arguments() -> None:
    with pytest.raises(ValueError, match=r"rollout='sglang'"):
        RLHFStrategy(rollout="sglang")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="worker_error_timeout_s"):
        RLHFStrategy(worker_error_timeout_s=0)


def test_attn_implementation_must_be_a_name(tiny_model: str) -> None:
    with pytest.raises(ValueError, match=r"RLHFModule\(attn_implementation=''\) is invalid.*HINT"):
        GRPOModule(tiny_model, reward=addition_reward, attn_implementation="")
    module = GRPOModule(tiny_model, reward=addition_reward, attn_implementation="eager")
    assert module.attn_implementation == "eager"


@pytest.mark.parametrize(("every", "warned"), [(50, True), (1, False)])
def test_a_run_too_short_for_its_logging_interval_is_told(tiny_model: str, every: int, warned: bool) -> None:
    import warnings

    import lightning as L

    module = GRPOModule(
        tiny_model, reward=addition_reward, reference=False, algorithm=AlgorithmConfig(kl=KLConfig(coef=0.0))
    )
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, log_every_n_steps=every, logger=False)
    module.trainer = trainer
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module.setup("fit")
    told = [str(w.message) for w in seen if "log_every_n_steps" in str(w.message)]
    assert bool(told) == warned
    if warned:
        assert told[0].startswith("Trainer(max_steps=8, log_every_n_steps=50): the loggers record every 50th step")
