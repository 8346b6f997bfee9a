"""Asynchronous rollouts, in one process: background role calls (threads under the controller), the truncated
importance weights, the weight bridge's bucket plan and the settings' checks. The multi-process runs (a rollout pool
fed over gloo, one-step off-policy training, resume) are in tests/distributed/test_async_rollouts.py."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

import lightning_rlhf.controller.controller as controller_module
from lightning_rlhf import AlgorithmConfig, AsyncConfig, FilteringConfig, KLConfig
from lightning_rlhf.batch import Batch
from lightning_rlhf.controller.controller import Controller, WorkerError
from lightning_rlhf.controller.dispatch import Dispatch, RoleFuture, controller_active, in_background, role_method
from lightning_rlhf.engines.rollout.bridge import _bucket_plan
from lightning_rlhf.placement.roles import prepare_roles
from lightning_rlhf.roles.actor import rollout_is_weights


class Slow:
    """A role whose ``work`` takes a while and records the thread it ran on."""

    name = "slow"

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    @role_method(Dispatch.DP_SPLIT)
    def work(self, batch: Batch) -> Batch:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(10), "the controller never let the background call finish"
        batch["y"] = batch["x"] * 2
        return batch

    @role_method(Dispatch.ONE_TO_ALL)
    def ping(self) -> str:
        return "pong"

    @role_method(Dispatch.ONE_TO_ALL)
    def fail(self) -> None:
        raise ValueError("broken on purpose")


class Other(Slow):
    name = "other"


def _controller(roles: dict[str, object]) -> Controller:
    pools = {"slow": (0,), "other": (0,)}
    return Controller(roles.__getitem__, rank=0, world_size=1, pools=pools)  # type: ignore[arg-type]


class ScriptedClock:
    """The controller module's ``time``, with a ``perf_counter`` that reads what the test sets (the rest is real)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_background_call_runs_in_a_thread_while_the_controller_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = Slow()
    controller = _controller({"slow": slow})
    batch = Batch({"x": torch.arange(4)})
    clock = ScriptedClock(100.0)
    monkeypatch.setattr(controller_module, "time", clock)
    with controller_active(controller):
        with in_background():
            future = slow.work(batch)
        assert isinstance(future, RoleFuture) and not future.done()
        # The call is still running (it waits for `release`): the controller is free meanwhile.
        assert slow.entered.wait(10), "the background call never started"
        assert slow.threads and slow.threads[0] != threading.current_thread().name
        clock.now = 107.25  # the call took 7.25 s by the clock its thread reads at its start and end
        slow.release.set()
        result = future.result()
    assert result["y"].tolist() == [0, 2, 4, 6]
    assert future.done() and future.seconds == 7.25


def test_a_busy_rank_refuses_other_calls_and_unread_calls_fail_the_step() -> None:
    slow, other = Slow(), Other()
    controller = _controller({"slow": slow, "other": other})

    def step() -> None:
        with in_background():
            slow.work(Batch({"x": torch.arange(2)}))
        with pytest.raises(RuntimeError, match=r"rank 0 is still running `slow.work`, started in the background"):
            other.ping()
        slow.release.set()  # ... and the step ends without reading the future

    with pytest.raises(RuntimeError, match=r"\['slow.work'\] still running in the background"):
        controller.run_step(step, [])
    assert (
        not controller._in_flight and not controller._background._threads
    )  # joined: the rank is free for the next step


def test_a_failing_background_call_raises_on_read() -> None:
    slow = Slow()
    controller = _controller({"slow": slow})
    with controller_active(controller):
        with in_background():
            future = slow.fail()
        with pytest.raises(WorkerError, match="broken on purpose"):
            future.result()


def test_without_a_controller_background_calls_run_at_once() -> None:
    slow = Slow()
    slow.release.set()
    with in_background():
        future = slow.work(Batch({"x": torch.arange(3)}))
    assert future.done() and future.result()["y"].tolist() == [0, 2, 4]


def test_truncated_importance_weights_per_token_and_per_sequence() -> None:
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.3, 0.3, 0.3]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.9, 0.4], [0.3, 0.1, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights, metrics = rollout_is_weights(old, behaviour, mask, level="token", cap=2.5)
    # ratios 2, 1, 0.5 | 1, 3 -> 2.5 (truncated); the padded token gets weight exp(0) = 1 and counts nowhere
    expected = torch.tensor([[2.0, 1.0, 0.5], [1.0, 2.5, 1.0]])
    assert torch.allclose(weights, expected, atol=1e-5)
    assert float(metrics["rollout_is_mean"]) == pytest.approx((2 + 1 + 0.5 + 1 + 2.5) / 5, abs=1e-5)
    assert float(metrics["rollout_is_clipfrac"]) == pytest.approx(1 / 5)
    weights, _ = rollout_is_weights(old, behaviour, mask, level="sequence", cap=2.5)
    # sequence products: 2 * 1 * 0.5 = 1 | 1 * 3 = 3 -> 2.5, on every token of the sequence
    assert torch.allclose(weights, torch.tensor([[1.0] * 3, [2.5] * 3]), atol=1e-5)
    assert not weights.requires_grad


def test_importance_weights_scale_the_clipped_loss_like_the_advantages() -> None:
    """Scaling the advantages by positive weights equals weighting the per-token clipped loss."""
    from lightning_rlhf.algorithms import compute_policy_loss

    logprobs = torch.log(torch.tensor([[0.6, 0.2, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.25, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 0.5]])
    w = torch.tensor([[2.0, 0.5, 1.5]])
    mask = torch.ones(1, 3)
    weighted, _ = compute_policy_loss("vanilla", logprobs, old, adv * w, mask)
    ratio = torch.exp(logprobs - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert float(weighted) == pytest.approx(float((w * per_token).mean()), rel=1e-6)


def test_bucket_plan_keeps_order_and_sends_a_large_tensor_alone() -> None:
    specs = [("a", (4,)), ("b", (4,)), ("big", (100,)), ("c", (2,)), ("d", (2,))]
    assert _bucket_plan(specs, 4, bucket_bytes=40) == [[0, 1], [2], [3, 4]]
    assert _bucket_plan(specs, 4, bucket_bytes=10**6) == [[0, 1, 2, 3, 4]]
    assert _bucket_plan([], 4, bucket_bytes=40) == []


def test_settings_of_asynchronous_rollouts() -> None:
    assert AlgorithmConfig().rollout_is_level == "none"
    assert AlgorithmConfig(asynchronous=AsyncConfig(max_staleness=1)).rollout_is_level == "token"
    assert AlgorithmConfig(asynchronous=AsyncConfig(max_staleness=1, rollout_is="none")).rollout_is_level == "none"
    with pytest.raises(ValueError, match=r"max_staleness=-1 is invalid: expected an integer >= 0"):
        AlgorithmConfig(asynchronous=AsyncConfig(max_staleness=-1))
    with pytest.raises(
        ValueError, match=r"asynchronous.max_staleness=1 is invalid: expected 0 with filtering.dynamic_sampling=True"
    ):
        AlgorithmConfig(filtering=FilteringConfig(dynamic_sampling=True), asynchronous=AsyncConfig(max_staleness=1))
    with pytest.raises(ValueError, match=r"rollout_is='tokens' is invalid"):
        AlgorithmConfig(asynchronous=AsyncConfig(rollout_is="tokens"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rollout_is_cap=1.0 is invalid: expected a truncation > 1"):
        AlgorithmConfig(asynchronous=AsyncConfig(rollout_is_cap=1.0))
    assert math.isclose(AlgorithmConfig().asynchronous.rollout_is_cap, 2.0)


def test_a_background_call_overlaps_the_controllers_own_work() -> None:
    """The background call and the controller's own work run at the same time, shown by the order of events rather
    than by a clock: the call starts, waits until the controller has done its own work, then finishes. Run one
    after the other, neither could finish (each waits for the other; the waits' generous limit only stops a hang)."""
    events: list[str] = []
    started, controller_done = threading.Event(), threading.Event()

    class Waiter(Slow):
        @role_method(Dispatch.DP_SPLIT)
        def work(self, batch: Batch) -> Batch:
            events.append("call started")
            started.set()
            events.append("call saw the controller's work" if controller_done.wait(60) else "call timed out")
            return batch

    waiter = Waiter()
    controller = _controller({"slow": waiter})
    with controller_active(controller):
        with in_background():
            future = waiter.work(Batch({"x": torch.arange(2)}))
        assert started.wait(60), "the background call never started"
        events.append("controller's own work")  # e.g. another pool's update
        controller_done.set()
        future.result()
    assert events == ["call started", "controller's own work", "call saw the controller's work"]
    assert future.done() and future.seconds > 0  # the call's own time, from its rank


def test_the_pending_rollout_survives_a_weights_only_checkpoint(demo_model: str, tmp_path: Path) -> None:
    """The rollout an asynchronous run generated for its next step goes into the checkpoint, dataset columns of any
    picklable type included (the metadata file is read with ``weights_only=True``)."""
    import numpy as np

    from lightning_rlhf import GRPOModule
    from lightning_rlhf.demo.task import addition_reward

    def module() -> GRPOModule:
        m = GRPOModule(
            demo_model,
            reward=addition_reward,
            algorithm=AlgorithmConfig(kl=KLConfig(coef=0.0), asynchronous=AsyncConfig(max_staleness=1)),
        )
        prepare_roles(m, ["actor", "reward", "rollout"])
        return m

    saved = module()
    assert saved.asynchronous and saved.rollout_role is not None and not saved.actor.needs_rollout_engine
    saved._pending_rollout = Batch(
        {"responses": torch.arange(6).view(2, 3), "weight_version": torch.tensor([4, 4])},
        {"answer": [np.int64(3), np.str_("7")], "prompt": ["1+2=", "3+4="]},
        {"step": 5},
    )
    checkpoint: dict = {}
    saved.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "meta.pt")
    restored = module()
    restored.on_load_checkpoint(torch.load(tmp_path / "meta.pt", weights_only=True))
    pending = restored._pending_rollout
    assert pending is not None
    assert pending["responses"].tolist() == [[0, 1, 2], [3, 4, 5]] and pending["weight_version"].tolist() == [4, 4]
    assert pending["answer"] == [3, "7"] and pending["prompt"] == ["1+2=", "3+4="] and pending.meta == {"step": 5}

    synchronous = GRPOModule(demo_model, reward=addition_reward, algorithm=AlgorithmConfig(kl=KLConfig(coef=0.0)))
    with pytest.warns(UserWarning, match="this run is synchronous: that rollout is dropped"):
        synchronous.on_load_checkpoint(torch.load(tmp_path / "meta.pt", weights_only=True))
    assert synchronous._pending_rollout is None
    prepare_roles(saved, ["actor", "reward"])  # a later fit without the pool: the actor generates again
    assert saved.rollout_role is None and saved.actor.needs_rollout_engine
