"""The reward: Python functions over decoded text and/or a transformers sequence-classification model."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RewardConfig
from lightning_rlhf.config.models import ensure_pad_token, resolve_model_path
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.rewards import (
    RewardComponent,
    RewardFn,
    RewardFunctionError,
    RewardSpec,
    call_reward_fn,
    reward_components,
    reward_fn_name,
    weighted_sum,
)
from lightning_rlhf.rewards.runner import close_reward_pools, reward_workers
from lightning_rlhf.roles.base import Role, load_model

__all__ = ["RewardFn", "RewardFunctionError", "RewardRole", "check_reward_model"]


_REWARD_MODEL_SHAPE = (
    "A reward model must be a sequence classifier (AutoModelForSequenceClassification) with exactly one output "
    "(num_labels=1): its one logit for prompt + completion is the score"
)
_REWARD_MODEL_HOWTO = (
    "add the one-output head with AutoModelForSequenceClassification.from_pretrained(<base or checkpoint>, "
    "num_labels=1, ignore_mismatched_sizes=True) (the new head starts random), train it on scored or preferred "
    "completions (e.g. TRL's RewardTrainer), and save_pretrained the result with its tokenizer; or score with a "
    "reward function instead"
)


def check_reward_model(path: str, *, setting: str) -> None:
    """Refuse a reward-model checkpoint that is not a sequence classifier with one output, before any weight loads.

    Reads ``config.json`` only (``AutoConfig``): a named architecture must be ``...ForSequenceClassification`` (a
    causal LM would get a new, random score head), and ``num_labels`` must be 1 (transformers reads a config
    without labels as 2). A config that cannot be read is left to the loader, which reports it.

    Runs on: every process, when the reward role is built (in the module's ``__init__``).

    Raises:
        ValueError: The checkpoint is not a sequence classifier, or has another number of outputs than one.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(path, setting=setting))
    except (OSError, ValueError):
        return  # not readable as a config (custom code, say): the loader says why, naming the setting
    architectures = [str(a) for a in getattr(config, "architectures", None) or []]
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"{setting}={path!r} is a {'/'.join(architectures)} checkpoint, not a sequence classifier: loaded as a "
            f"reward model it would get a new, random score head, so every reward would be noise. "
            f"{_REWARD_MODEL_SHAPE}. HINT: make one from this checkpoint: {_REWARD_MODEL_HOWTO}."
        )
    if config.num_labels != 1:
        raise ValueError(
            f"{setting}={path!r} is a sequence classifier with {config.num_labels} outputs (num_labels="
            f"{config.num_labels}, as transformers reads its config.json). {_REWARD_MODEL_SHAPE}. "
            f"HINT: {_REWARD_MODEL_HOWTO}."
        )


class RewardRole(Role):
    """Scores rollouts into ``scores`` ``[B]`` (or the column ``key``): one reward, or several combined.

    Runs on: every process; ``score`` runs on all ranks, each on its share of the rollouts.

    Args:
        reward: a reward function, the path / hub id of a sequence-classification model with one output, or
            ``{name: function or model path}`` (any number of functions, at most one model), combined as
            ``sum(weight * score)`` with ``config.weights``.
        tokenizer: the actor's tokenizer, to decode responses.
        key: the column the scores go to (a Safe-RLHF cost role writes ``costs``).
        config: how functions are called (timeout, fallback, batches) and the weights. None: in-process, without a
            timeout (``RLHFModule`` passes its ``reward_config``: reward worker processes).
    """

    name = "reward"

    def __init__(
        self,
        reward: RewardSpec,
        *,
        tokenizer: Any,
        micro_batch_size: int,
        key: str = "scores",
        config: RewardConfig | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(micro_batch_size=micro_batch_size, dtype=dtype, setting="RewardRole(reward=...)")
        self.key = key
        self.config = config or RewardConfig(timeout_s=None)
        self.components: list[RewardComponent] = reward_components(reward, weights=self.config.weights)
        model = next((c for c in self.components if c.is_model), None)
        self.path: str | None = model.source if model is not None and isinstance(model.source, str) else None
        if self.path is not None:
            check_reward_model(self.path, setting="RewardRole(reward=...)")
        self.tokenizer = tokenizer
        self._model_tokenizer: Any = None

    def load(self) -> None:
        """Load the reward model, if a component is one, and start the reward functions' worker processes
        (with ``config.timeout_s`` set), which load their functions meanwhile. Runs on: every rank, before sharding."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self.config.timeout_s is not None:
            for c in self.components:
                if not isinstance(c.source, str):
                    reward_workers(c.source, name=self._fn_label(c)).start(self.config.num_workers)

        if self.path is not None and self.model is None:
            path = resolve_model_path(self.path, setting="RewardRole(reward=...)")
            model = load_model(
                AutoModelForSequenceClassification,
                path,
                setting="RewardRole(reward=...)",
                dtype=self.dtype,
                num_labels=1,
            )
            self.set_model(model.eval().requires_grad_(False))
            self._model_tokenizer = AutoTokenizer.from_pretrained(path)
            self._model_tokenizer.padding_side = "right"
            ensure_pad_token(self._model_tokenizer, source=path)
            config: Any = model.config
            if getattr(config, "pad_token_id", None) is None:
                config.pad_token_id = self._model_tokenizer.pad_token_id

    @role_method(Dispatch.DP_SPLIT)
    def score(self, batch: Batch) -> Batch:
        """Decode the responses into ``completion``, score them with every component and write the weighted
        sum into ``scores`` (or the role's ``key``), each component's scores to ``<role name>/<component>`` ``[B]``
        and its samples that got the fallback score to ``<role name>/<component>/failed`` ``[B]`` (bool).

        Runs on: every worker rank. Functions run as ``RewardConfig`` says; the model runs here.
        """
        completions = [
            self.tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True)
            for row, m in zip(batch["responses"], batch["response_mask"], strict=True)
        ]
        batch["completion"] = completions
        prompts = list(batch["prompt"]) if "prompt" in batch else [""] * len(batch)
        columns = {k: v for k, v in batch.columns.items() if k not in ("prompt", "completion")}
        cfg = self.config
        scores: dict[str, torch.Tensor] = {}
        for c in self.components:
            failed = torch.zeros(len(batch), dtype=torch.bool)
            if isinstance(c.source, str):
                scores[c.name] = self._score_model(self._model_texts(batch, prompts, completions))
            else:
                out = call_reward_fn(
                    c.source,
                    prompts,
                    completions,
                    columns,
                    timeout_s=cfg.timeout_s,
                    fallback_score=cfg.fallback_score,
                    batch_size=cfg.batch_size,
                    num_workers=cfg.num_workers,
                    on_exception=cfg.on_exception,
                    name=self._fn_label(c),
                )
                scores[c.name], failed = out.scores, out.failed
            batch[f"{self.name}/{c.name}"] = scores[c.name]
            batch[f"{self.name}/{c.name}/failed"] = failed
        batch[self.key] = weighted_sum(scores, {c.name: c.weight for c in self.components})
        return batch

    def close(self) -> None:
        """End the worker processes of this role's reward functions (idempotent; scoring again restarts them).
        Runs on: every rank, at teardown (interpreter exit closes them too)."""
        close_reward_pools([c.source for c in self.components if not isinstance(c.source, str)])

    @staticmethod
    def _fn_label(c: RewardComponent) -> str:
        """How a function component is named in messages: its name, and the function's when they differ."""
        fn_name = reward_fn_name(c.source)  # type: ignore[arg-type]
        return fn_name if fn_name.strip("<>") == c.name else f"{c.name}` (`{fn_name}`)"

    def metrics(self, batch: Batch) -> dict[str, float]:
        """Each component's mean score and failed-sample count over a scored batch (all ranks' samples).

        Runs on: controller. Keys: ``<role name>/<component>/mean`` and ``<role name>/<component>/failed`` (samples
        that got ``RewardConfig.fallback_score``: their call timed out or crashed)."""
        out: dict[str, float] = {}
        for c in self.components:
            column = f"{self.name}/{c.name}"
            if column in batch:
                out[f"{column}/mean"] = float(batch[column].float().mean())
                out[f"{column}/failed"] = float(batch[f"{column}/failed"].sum())
        return out

    _no_template_warned = False

    def _model_texts(self, batch: Batch, prompts: list[str], completions: list[str]) -> tuple[list[str], bool]:
        """The texts the reward model scores and whether its tokenizer adds its special tokens to them: chat prompts
        (marked in ``batch.meta``) rendered with the completion as the assistant's turn by the reward model's own
        chat template (as TRL and verl score them); else ``prompt + completion``. Runs on: every worker rank."""
        tok = self._model_tokenizer
        if not batch.meta.get("chat_prompt"):
            return [p + c for p, c in zip(prompts, completions, strict=True)], True
        if getattr(tok, "chat_template", None) is None:
            if not RewardRole._no_template_warned:
                RewardRole._no_template_warned = True
                rank_zero_warn(
                    f"RewardRole: the prompts are chats but the reward model's tokenizer ({self.path}) has no chat "
                    "template, so it scores `prompt + completion` (the last user message's text and the response). "
                    "HINT: save the reward model with the chat template it was trained with (docs/rewards.md).",
                    category=UserWarning,
                )
            return [p + c for p, c in zip(prompts, completions, strict=True)], True
        column = batch.meta.get("messages_column")
        chats = [list(m) for m in batch[column]] if column else [[{"role": "user", "content": p}] for p in prompts]
        kwargs = batch.meta.get("chat_template_kwargs") or {}  # PromptDataModule(chat_template_kwargs=...)
        texts = [
            tok.apply_chat_template([*chat, {"role": "assistant", "content": c}], tokenize=False, **kwargs)
            for chat, c in zip(chats, completions, strict=True)
        ]
        return texts, False

    def _score_model(self, texts_and_specials: tuple[list[str], bool]) -> torch.Tensor:
        device = self.train_engine.device
        texts, add_special_tokens = texts_and_specials

        def forward(model: torch.nn.Module, micro: Batch) -> dict[str, torch.Tensor]:
            enc = self._model_tokenizer(
                list(micro["text"]), return_tensors="pt", padding=True, add_special_tokens=add_special_tokens
            ).to(device)
            return {"scores": model(**enc).logits[:, 0].float()}

        return self.train_engine.infer(Batch(columns={"text": texts}), forward)["scores"]
