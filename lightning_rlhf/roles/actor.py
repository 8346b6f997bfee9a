"""The actor: the trainable policy, and the rollout engine it feeds with its weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_rlhf.algorithms import (
    MicroBatchAggregation,
    compute_policy_loss,
    kl_penalty,
    mismatch_metrics,
    rollout_is_weights,
    rollout_log_ratio,
    rollout_mask,
    rollout_probs_diff,
)
from lightning_rlhf.algorithms.mismatch import MISMATCH_METRICS
from lightning_rlhf.batch import Batch, sampled_mask
from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.engines.hybrid import HybridEngine
from lightning_rlhf.engines.rollout import RolloutEngine
from lightning_rlhf.engines.rollout.base import logprob_temperature
from lightning_rlhf.engines.rollout.bridge import WeightBridge
from lightning_rlhf.engines.train import RESPONSE_INPUTS, MetricAccumulator, forward_response, world
from lightning_rlhf.engines.train.vision import freeze_vision_tower
from lightning_rlhf.roles.base import EpisodesMixin, Role, RolloutEngineRequest, load_model

__all__ = ["ActorRole", "rollout_is_weights", "rollout_probs_diff"]


class ActorRole(EpisodesMixin, Role):
    """Trainable causal LM. ``generate`` samples rollouts, ``log_prob`` scores them, ``update`` trains on them.

    ``path``: local folder or hub id of a transformers causal LM; ``lora``: a ``peft.LoraConfig`` to train LoRA
    adapters on the frozen model (``RLHFModule(lora=...)``).

    Runs on: every process; its methods are called by the controller and run on all ranks.
    """

    name = "actor"

    def __init__(
        self,
        path: str,
        *,
        tokenizer: Any,
        rollout: RolloutConfig,
        algorithm: AlgorithmConfig,
        optim: OptimConfig,
        lora: Any = None,
        train_vision_tower: bool = False,
    ) -> None:
        super().__init__(
            micro_batch_size=algorithm.batching.micro_batch_size, optim=optim, setting="ActorRole(path=...)", lora=lora
        )
        if algorithm.asynchronous.rollout_mask != "none" and algorithm.loss.policy_loss not in ZERO_AT_ZERO_ADVANTAGE:
            raise ValueError(
                f"AlgorithmConfig.asynchronous.rollout_mask={algorithm.asynchronous.rollout_mask!r} with "
                f"loss.policy_loss={algorithm.loss.policy_loss!r}: the mask leaves a token out by zeroing its "
                f"advantage, which gives no gradient only with a built-in loss ({sorted(ZERO_AT_ZERO_ADVANTAGE)}). "
                "HINT: use one of those, or rollout_mask='none'."
            )
        self.path = path
        self.train_vision_tower = train_vision_tower
        """A vision-language actor: train the vision tower too (default: frozen, the language model alone learns)."""
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.algorithm = algorithm
        self.needs_rollout_engine = True  # SFTModule turns it off: it never generates
        self.hybrid = HybridEngine(rollout=rollout, tokenizer=tokenizer, model_path=path, trainer=self)
        """The colocated engine's memory phases, weight hand-offs and policy versions (not an nn.Module attribute:
        stays out of checkpoints)."""
        self.weight_bridge: WeightBridge | None = None
        """Set by the strategy when a generation-only pool takes this role's weights (``send_weights``)."""

    @property
    def logprob_temperature(self) -> float:
        """The temperature of every log-prob the loss uses (old, new; the reference role uses the same):
        ``RolloutConfig.temperature``, or 1 (the raw policy) for greedy rollouts (temperature 0)."""
        return logprob_temperature(self.rollout.temperature)

    @property
    def rollout_engine(self) -> RolloutEngine:
        """The colocated rollout engine (attached by the strategy at set-up)."""
        if self.hybrid.engine is None and not self.needs_rollout_engine:
            raise RuntimeError(
                "ActorRole has no rollout engine: generation runs on the placement's 'rollout' pool (or this module "
                "never generates). HINT: call `self.generate_rollout(batch, ...)` in the dataflow, not "
                "`self.actor.generate`."
            )
        return self.hybrid.rollout_engine

    def rollout_engine_request(self) -> RolloutEngineRequest | None:
        """The actor's model, path, tokenizer and sampling settings (None when ``needs_rollout_engine`` is off)."""
        return RolloutEngineRequest(self.path, self.tokenizer, self.rollout) if self.needs_rollout_engine else None

    def attach_engine(self, engine: RolloutEngine) -> None:
        """Attach the rollout engine. Runs on: every worker rank, at set-up, before sharding."""
        self.hybrid.engine = engine

    def load(self) -> None:
        """Load the causal LM with transformers, in float32 (the master weights). Runs on: every process."""
        from transformers import AutoModelForCausalLM

        if self.model is None:
            model = load_model(
                AutoModelForCausalLM, self.path, setting="ActorRole(path=...)", dtype=self.dtype, lora=self.lora
            )
            if not self.train_vision_tower:
                freeze_vision_tower(model)
            self.set_model(model.train())  # from_pretrained returns eval mode; dropout is off anyway

    # --------------------------------------------------------------------------------------- rollout
    def mark_weights_changed(self) -> None:
        """Make the next ``generate`` hand the weights to the engine first (after an update or a restore)."""
        self.hybrid.mark_changed()

    def forget_handoffs(self) -> None:
        """Make the next ``send_weights`` send whatever the staleness bound (after a restore: the rollout pool holds
        weights of another run). Runs on: every process."""
        self.hybrid.sent_version = None

    @property
    def policy_version(self) -> int:
        """The number of updates behind the current weights (the schedule's step count: restored on resume).
        Runs on: a rank that holds the actor (0 elsewhere)."""
        scheduler = self.train_engine.scheduler
        return int(scheduler.last_epoch) if scheduler is not None and self.model is not None else 0

    @role_method(Dispatch.ONE_TO_ALL)
    def send_weights(self, *, lag: int = 0, max_staleness: int = 0) -> dict[str, float]:
        """Hand the weights to the generation-only pool (:meth:`HybridEngine.send
        <lightning_rlhf.engines.hybrid.HybridEngine.send>`), unless the staleness bound allows to keep the ones it
        has: samples it generates now are trained on ``lag`` updates later, at most ``max_staleness`` updates old.

        Runs on: every rank of the actor's pool (the FSDP gathers); the pool's first rank broadcasts to the rollout
        role's ``receive_weights``, in the same ``concurrently()`` block.
        """
        if self.weight_bridge is None:
            raise RuntimeError(
                "ActorRole.send_weights: no generation-only pool takes this actor's weights. HINT: it is called by "
                "RLHFModule.sync_rollout_weights when the placement has a 'rollout' pool."
            )
        return self.hybrid.send(self.weight_bridge, version=self.policy_version, lag=lag, max_staleness=max_staleness)

    # ------------------------------------------------------------------------------------- training
    @role_method(Dispatch.DP_SPLIT, reads=RESPONSE_INPUTS, writes=("old_logprobs",), sequence_parallel=True)
    def log_prob(self, batch: Batch) -> Batch:
        """Log-probs of the sampled responses under the current weights, as ``old_logprobs`` ``[B, R]``.
        Runs on: every worker rank (FSDP forward, micro-batched)."""
        temperature = self.logprob_temperature
        group = self._group_size(batch)
        kernels = self.train_engine.layer.token_kernels()
        out = self.train_engine.infer(
            batch,
            lambda model, micro: forward_response(
                model, micro, output="logprobs", temperature=temperature, group_size=group, kernels=kernels
            ),
        )
        batch["old_logprobs"] = out["logprobs"]
        return batch

    @role_method(Dispatch.DP_SPLIT, sequence_parallel=True)
    def update(self, batch: Batch) -> dict[str, float]:
        """PPO-style policy update: clipped loss (+ KL loss, - entropy bonus) over epochs and mini-batches.

        Runs on: every worker rank. Needs ``advantages`` (and ``ref_logprobs`` when the KL is in the loss).
        Without ``old_logprobs`` the update must be on-policy (one epoch, one mini-batch): the old log-probs are then
        the detached ones of this very forward pass (exact, and it saves the ``log_prob`` pass).
        """
        algo = self.algorithm
        use_kl_loss = algo.kl.coef > 0 and not algo.kl.in_reward
        if use_kl_loss and "ref_logprobs" not in batch:
            raise KeyError("ActorRole.update: kl_coef > 0 needs `ref_logprobs`: call reference.log_prob first.")
        mini_size = algo.batching.mini_batch_size or len(batch) * world()[1]
        if "old_logprobs" not in batch and (algo.batching.ppo_epochs > 1 or mini_size < len(batch) * world()[1]):
            raise KeyError(
                "ActorRole.update: `old_logprobs` missing and the update is off-policy (several epochs or "
                "mini-batches). HINT: call actor.log_prob(rollout) before actor.update."
            )
        diffs = MetricAccumulator()
        staleness = self._staleness(batch)
        fresh = staleness is None or staleness["staleness_max"] == 0  # sampled with the weights being updated

        def loss_fn(micro: Batch, agg: MicroBatchAggregation) -> tuple[Tensor, dict[str, Tensor]]:
            loss, metrics, logprobs = self._policy_loss(micro, agg, use_kl_loss)
            if agg.counts and fresh and "rollout_logprobs" in micro and "old_logprobs" not in micro:  # on-policy
                diffs.add(rollout_probs_diff(logprobs, micro["rollout_logprobs"], sampled_mask(micro)))
            return loss, metrics

        acc = self.train_engine.train(
            batch,
            loss_fn,
            aggregation=algo.loss.loss_agg,
            count_mask=_loss_mask,
            mini_batch_size=mini_size,
            epochs=algo.batching.ppo_epochs,
            max_len=self.rollout.max_new_tokens,  # the constant of seq-mean-token-sum-norm (Dr.GRPO)
            trainable=_advantage_rows if self._skips_zero_advantage(use_kl_loss) else None,
        )
        acc.add({"lr": torch.tensor(self.train_engine.step_scheduler())})
        self.mark_weights_changed()
        extra = {f"training/{k}": v for k, v in (staleness or {}).items()}
        result = {_metric_name(k): v for k, v in acc.result("actor").items()}
        return result | diffs.result("training") | extra

    def split_costs(self, method: str, batch: Batch) -> list[int] | None:
        """Per-row costs by which the controller balances a ``DP_SPLIT`` call's rows over ranks, or None for the
        usual split: for :meth:`update` when it skips zero-advantage samples and is one mini-batch, a row's tokens
        if it trains, else 0, so every rank trains about as many tokens (GRPO's groups kept whole).

        Runs on: the controller (:func:`~lightning_rlhf.controller.dispatch.role_method`).
        """
        algo = self.algorithm
        one_mini_batch = algo.batching.mini_batch_size is None or algo.batching.mini_batch_size >= len(batch)
        if method != "update" or "advantages" not in batch or not one_mini_batch:
            return None
        if not self._skips_zero_advantage(algo.kl.coef > 0 and not algo.kl.in_reward):
            return None
        tokens = batch["response_mask"].long().sum(dim=1)
        if "prompt_mask" in batch:
            tokens = tokens + batch["prompt_mask"].long().sum(dim=1)
        return (tokens * _advantage_rows(batch)).tolist()

    def _skips_zero_advantage(self, use_kl_loss: bool) -> bool:
        """Whether a sample whose advantages are all 0 has a zero gradient and may be skipped
        (``AlgorithmConfig.batching.skip_zero_advantage``): with a built-in policy loss (``-A * (clipped ratio)``),
        no entropy bonus and no KL in the loss; never with an overridden ``_policy_loss``."""
        algo = self.algorithm
        return (
            algo.batching.skip_zero_advantage
            and type(self)._policy_loss is ActorRole._policy_loss  # an overridden loss may add a term
            and algo.loss.policy_loss in ZERO_AT_ZERO_ADVANTAGE
            and algo.loss.entropy_coef == 0
            and not use_kl_loss
        )

    def _group_size(self, batch: Batch) -> int:
        """Samples per prompt in ``batch`` for the shared-prefix forward (1: off, or not a grouped rollout)."""
        return int(batch.meta.get("group_size", 1)) if self.algorithm.batching.shared_prefix else 1

    def _staleness(self, batch: Batch) -> dict[str, float] | None:
        """How many updates old this rank's samples are (``weight_version`` from a generation-only pool; None: no
        version), checked against ``AlgorithmConfig.asynchronous.max_staleness``."""
        if "weight_version" not in batch:
            return None
        lag = (self.policy_version - batch["weight_version"]).float()
        worst = float(lag.max()) if lag.numel() else 0.0
        if worst > self.algorithm.asynchronous.max_staleness:
            raise RuntimeError(
                f"ActorRole.update: samples are {worst:.0f} updates older than the weights being trained, more than "
                f"AlgorithmConfig.asynchronous.max_staleness={self.algorithm.asynchronous.max_staleness}. HINT: hand "
                "the weights over (RLHFModule.sync_rollout_weights) before generating, or raise "
                "asynchronous.max_staleness."
            )
        return {"staleness_max": worst, "staleness_mean": float(lag.mean()) if lag.numel() else 0.0}

    def _policy_loss(
        self, micro: Batch, agg: MicroBatchAggregation, use_kl_loss: bool
    ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """The policy loss of one micro-batch (+ KL loss, - entropy bonus), its metrics and its log-probs."""
        algo = self.algorithm
        assert self.model is not None
        device = self.train_engine.device
        out = forward_response(
            self.model,
            micro,
            output="logprobs",
            temperature=self.logprob_temperature,
            with_entropy=True,
            entropy_grad=algo.loss.entropy_coef != 0,  # at 0 the entropy is only reported: no backward through it
            group_size=self._group_size(micro),
            kernels=self.train_engine.layer.token_kernels(),
        )
        mask = _loss_mask(micro).to(device)
        old = micro["old_logprobs"].to(device) if "old_logprobs" in micro else out["logprobs"].detach()
        advantages, keep, is_metrics = self._rollout_correction(micro, old, mask, micro["advantages"].to(device))
        pg_loss, metrics = compute_policy_loss(
            algo.loss.policy_loss,
            out["logprobs"],
            old,
            advantages,
            mask,
            clip_low=algo.loss.clip_ratio_low,
            clip_high=algo.loss.clip_ratio_high,
            clip_ratio_c=algo.loss.clip_ratio_c,
            tau_pos=algo.loss.sapo_tau_pos,
            tau_neg=algo.loss.sapo_tau_neg,
            dppo_kl_threshold=algo.loss.dppo_kl_threshold,
            dppo_tv_threshold=algo.loss.dppo_tv_threshold,
            **agg.loss_kwargs,
        )
        entropy = agg.aggregate(out["entropy"] if keep is None else out["entropy"] * keep, mask)
        loss = pg_loss - algo.loss.entropy_coef * entropy
        report = {
            "pg_loss": agg.report(pg_loss, mask),
            "entropy": agg.report(entropy, mask),
            **metrics,
            **is_metrics,
        }
        if use_kl_loss:
            kl = kl_penalty(out["logprobs"], micro["ref_logprobs"].to(device), estimator=algo.kl.estimator)
            kl_loss = agg.aggregate(kl if keep is None else kl * keep, mask)
            loss = loss + algo.kl.coef * kl_loss
            report["kl_loss"] = agg.report(kl_loss, mask)
        return loss, report, out["logprobs"].detach()

    def _rollout_correction(
        self, micro: Batch, old: Tensor, mask: Tensor, advantages: Tensor
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        """The correction for the gap between the rollout policy and the trained one, on a micro-batch with
        ``rollout_logprobs`` (else nothing): the advantages scaled by the truncated importance weights
        (``rollout_is``) and zeroed on the tokens ``rollout_mask`` leaves out (so is their policy-gradient term and
        gradient), the tokens kept (None: all) and the metrics, ``rollout_is_*`` and
        :data:`~lightning_rlhf.algorithms.mismatch.MISMATCH_METRICS` (logged as ``rollout/*`` by :meth:`update`)."""
        if "rollout_logprobs" not in micro:
            return advantages, None, {}
        settings = self.algorithm.asynchronous
        rollout = micro["rollout_logprobs"].to(mask.device)
        metrics: dict[str, Tensor] = {}
        if self.algorithm.rollout_is_level != "none":
            level, cap = self.algorithm.rollout_is_level, settings.rollout_is_cap
            weights, metrics = rollout_is_weights(old, rollout, mask, level=level, cap=cap)
            advantages = advantages * weights  # weights > 0 commute with the clipped losses' max/min
        log_ratio = rollout_log_ratio(old, rollout, mask)
        keep = None
        if settings.rollout_mask != "none":
            low, high = settings.rollout_mask_bounds
            keep = rollout_mask(log_ratio, mask, mode=settings.rollout_mask, low=low, high=high)
            advantages = advantages * keep  # a zero advantage: the built-in losses give 0 and no gradient
        return advantages, keep, metrics | mismatch_metrics(log_ratio, mask, keep)

    # ------------------------------------------------------------------------------- supervised (SFT)
    @role_method(Dispatch.DP_SPLIT)
    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One supervised optimizer step: the cross-entropy of every token whose ``loss_mask`` is 1 given the
        tokens before it, as a token mean over the whole batch (all ranks), then one AdamW and one scheduler step.

        Runs on: every worker rank, on its share of the examples (``input_ids``, ``attention_mask``,
        ``loss_mask`` ``[B, T]``, right-padded, from :class:`~lightning_rlhf.data.SFTDataModule`); ``sft/tokens``
        counts the loss tokens of all ranks.
        """
        sums: list[Tensor] = []
        per_rank: list[Tensor] = []  # the engine's per-rank share of the global loss-token count (one all-reduce)

        def loss_fn(micro: Batch, agg: MicroBatchAggregation) -> tuple[Tensor, dict[str, Tensor]]:
            token_loss, mask = self._sft_token_losses(micro)
            sums.append((token_loss * mask).sum().detach())
            assert agg.num_tokens is not None  # token-mean: the engine counted the tokens of all ranks
            per_rank[:] = [agg.num_tokens]
            return agg.aggregate(token_loss, mask), {}

        acc = self.train_engine.train(
            batch, loss_fn, aggregation="token-mean", count_mask=lambda b: b["loss_mask"][:, 1:]
        )
        metrics = acc.result("sft")
        lr = self.train_engine.step_scheduler()
        self.mark_weights_changed()
        total = (per_rank[0] * world()[1]).clamp(min=1)
        return {
            "sft/loss": float(torch.stack(sums).sum() / (total / world()[1])),
            "sft/grad_norm": metrics["sft/grad_norm"],
            "sft/lr": lr,
            "sft/tokens": float(total),
            "sft/update_skipped": metrics["sft/update_skipped"],
        }

    @role_method(Dispatch.DP_SPLIT)
    def sft_loss(self, batch: Batch) -> dict[str, float]:
        """The summed token loss (``loss_sum``) and the loss-token count (``tokens``) of this rank's share of an
        SFT batch, without gradients (validation). Runs on: every worker rank (FSDP forward, micro-batched)."""

        def sums(model: torch.nn.Module, micro: Batch) -> dict[str, Tensor]:
            token_loss, mask = self._sft_token_losses(micro)
            return {"loss_sum": (token_loss * mask).sum().reshape(1), "tokens": mask.sum().reshape(1)}

        out = self.train_engine.infer(batch, sums)
        return {"loss_sum": float(out["loss_sum"].sum()), "tokens": float(out["tokens"].sum())}

    def _sft_token_losses(self, micro: Batch) -> tuple[Tensor, Tensor]:
        """Per-token cross-entropy ``[B, T-1]`` of ``input_ids[:, 1:]`` and its loss mask, padding trimmed."""
        assert self.model is not None
        device = self.train_engine.device
        width = max(2, int(micro["attention_mask"].sum(-1).max()))
        ids = micro["input_ids"][:, :width].to(device)
        mask = micro["attention_mask"][:, :width].to(device)
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        token_loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none"
        )
        return token_loss, micro["loss_mask"][:, 1:width].to(device).float()


ZERO_AT_ZERO_ADVANTAGE = frozenset({"vanilla", "dual_clip", "gspo", "cispo", "sapo", "gpg", "dppo_kl", "dppo_tv"})
"""Registered policy losses whose loss, and so gradient, is 0 for a sample whose advantages are all 0."""


def _metric_name(key: str) -> str:
    """``rollout/<name>`` for the update's ``actor/<name>`` of the rollout-mismatch metrics, else ``key``."""
    name = key.removeprefix("actor/")
    return f"rollout/{name}" if name in MISMATCH_METRICS else key


def _advantage_rows(batch: Batch) -> Tensor:
    """``[B]`` bool: rows with a nonzero advantage on a token that counts in the loss."""
    return ((batch["advantages"] != 0) & _loss_mask(batch).bool()).any(dim=1)


def _loss_mask(batch: Batch) -> Tensor:
    """Tokens that count in the loss: ``loss_mask`` when the dataflow set one (e.g. DAPO's overlong
    filtering), else the sampled response tokens (:func:`~lightning_rlhf.batch.sampled_mask`)."""
    return batch["loss_mask"] if "loss_mask" in batch else sampled_mask(batch)
