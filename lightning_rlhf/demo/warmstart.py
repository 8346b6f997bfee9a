"""Supervised warm start of the tiny demo model with :class:`~lightning_rlhf.modules.SFTModule`, its on-disk
cache, and accuracy checks.

A randomly initialised tiny model never produces a correct sum, so RL has no signal. A few dozen supervised
steps on the training prompts (:func:`~lightning_rlhf.demo.task.addition_splits`; the held-out ones are never
trained on) bring it to a partly-right policy that RL can then visibly improve."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lightning_rlhf.demo.task import addition_dataset, addition_reward, addition_splits
from lightning_rlhf.demo.tiny import save_tiny

log = logging.getLogger(__name__)

CACHE_VERSION = "v4"
"""Bumped whenever the tiny model, tokenizer or warm start change, so stale caches are not reused (v4: the chat
template and 256 positions; the weights are those of v3)."""


def _load(model_dir: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer


def warm_start(
    model_dir: str,
    out_dir: str,
    *,
    steps: int = 40,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    digits: int = 1,
    task: str = "addition",
    timeout_s: float = 600.0,
) -> str:
    """Fine-tunes the model in ``model_dir`` on the training split of the addition task with
    :class:`~lightning_rlhf.modules.SFTModule` and saves it (model and tokenizer) to ``out_dir``; returns ``out_dir``.

    A one-process Lightning ``fit`` (``SFTDataModule`` over ``addition_splits(digits=digits)["train"]``: loss on the
    answer and EOS only, AdamW at ``lr``, ``steps`` steps of ``batch_size`` examples, shuffled with ``seed``) in a
    fresh Python process: it never shares a process group with the caller, so a script may call this and then start
    a multi-process ``fit``. Deterministic for a given seed; a few seconds, most of it the new interpreter's imports.
    ``task="tools"`` trains on the tool task's transcripts instead
    (:func:`~lightning_rlhf.demo.tool_task.tool_transcripts`), for a model saved with the tool template. The child
    is killed after ``timeout_s``. Runs on: any process (launches and waits for a child process).

    Raises:
        RuntimeError: the child process failed (its output's end is in the message) or timed out.
    """
    args = [
        model_dir, out_dir, "--steps", str(steps), "--batch-size", str(batch_size), "--lr", repr(lr),
        "--seed", str(seed), "--digits", str(digits), "--task", task,
    ]  # fmt: skip
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # a 300k-parameter model gains nothing from threads; on a busy CPU they cost
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
    }
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a caller inside a distributed run must not make the child join its process group
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_rlhf.demo.warmstart", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(
            f"warm_start({model_dir!r}): the SFT run did not finish within timeout_s={timeout_s:g}. HINT: the "
            "machine may be overloaded; retry, or raise timeout_s."
        ) from err
    if proc.returncode != 0 or not os.path.isfile(os.path.join(out_dir, "config.json")):
        raise RuntimeError(
            f"warm_start({model_dir!r}): the SFT run exited with {proc.returncode}.\n--- its output (end) ---\n"
            f"{(proc.stdout + proc.stderr)[-4000:]}"
        )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    log.info("warm start: %s (%.1f s)", summary, time.perf_counter() - start)
    return out_dir


def _sft_data(task: str, *, digits: int, batch_size: int, seed: int) -> Any:
    """The warm start's ``SFTDataModule`` for ``task``."""
    from lightning_rlhf.data import SFTDataModule

    if task == "tools":
        import datasets

        from lightning_rlhf.demo.tool_task import tool_splits, tool_transcripts

        train = tool_splits()["train"]
        rows = tool_transcripts(train, with_tool=True) + tool_transcripts(train, with_tool=False)
        return SFTDataModule(
            datasets.Dataset.from_list(rows), messages_column="messages", batch_size=batch_size, seed=seed
        )
    if task != "addition":
        raise ValueError(f"warm_start(task={task!r}): expected 'addition' or 'tools'.")
    return SFTDataModule(addition_splits(digits=digits)["train"], batch_size=batch_size, max_length=32, seed=seed)


def _warm_start_here(
    model_dir: str, out_dir: str, *, steps: int, batch_size: int, lr: float, seed: int, digits: int, task: str
) -> dict[str, float]:
    """The SFT run :func:`warm_start` launches; returns the first and last ``sft/loss``. Runs on: one process."""
    import lightning as L

    from lightning_rlhf.callbacks import ExportActor
    from lightning_rlhf.callbacks.history import MetricHistory
    from lightning_rlhf.config import OptimConfig
    from lightning_rlhf.modules import SFTModule
    from lightning_rlhf.strategy import RLHFStrategy

    L.seed_everything(seed, verbose=False)
    module = SFTModule(model_dir, optim=OptimConfig(lr=lr), micro_batch_size=batch_size)
    data = _sft_data(task, digits=digits, batch_size=batch_size, seed=seed)
    history = MetricHistory(["sft/loss"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=RLHFStrategy("hf"),
        max_steps=steps,
        logger=False,
        callbacks=[ExportActor(out_dir), history],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    losses = history.values("sft/loss")[1]
    return {"first": losses[0], "last": losses[-1], "steps": float(len(losses))}


def build_once(cache_dir: str, name: str, build: Callable[[str], str]) -> str:
    """``cache_dir/name``, made by ``build(tmp_folder) -> model folder`` on first use in a temporary folder inside
    ``cache_dir`` that is then renamed into place, so concurrent callers never see a partial model (the first
    rename wins; the others find a complete folder)."""
    final = os.path.join(cache_dir, name)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-tmp-", dir=cache_dir)
    try:
        built = build(tmp)
        if os.path.isdir(final) and not os.path.isfile(os.path.join(final, "config.json")):
            shutil.rmtree(final, ignore_errors=True)  # a foreign, incomplete leftover
        try:
            os.replace(built, final)
        except OSError:
            # Another process finished first (its directory is complete, since it was renamed in whole).
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def prepare_demo_model(cache_dir: str, *, seed: int = 0, warm_start_steps: int = 40) -> str:
    """Returns the folder of a warm-started tiny demo model (model and tokenizer), building and caching it on first use.

    The model lives in ``cache_dir/demo-model-{CACHE_VERSION}-seed{seed}-ws{warm_start_steps}``, reused as is once it
    has a ``config.json``. Otherwise a tiny model is built (:func:`save_tiny`, ``seed``) and warm-started
    (:func:`warm_start`: ``warm_start_steps`` SFT steps in a child process), see :func:`build_once`. Call it before
    starting a multi-process ``fit``: the other ranks then find the model cached. Runs on: any process (plain function).
    """

    def build(tmp: str) -> str:
        base = save_tiny(os.path.join(tmp, "base"), seed=seed)
        return warm_start(base, os.path.join(tmp, "model"), steps=warm_start_steps, seed=seed)

    return build_once(cache_dir, f"demo-model-{CACHE_VERSION}-seed{seed}-ws{warm_start_steps}", build)


def prepare_demo_teacher(cache_dir: str, *, task: str = "addition", seed: int = 0) -> str:
    """The demo's teacher for on-policy distillation: the ``task``'s warm start (:func:`prepare_demo_model` or
    :func:`prepare_tool_model`) after the demo's default GRPO run (``python -m lightning_rlhf.demo --task
    TASK``, its task's steps, in a child process), its exported actor cached in
    ``cache_dir/demo-teacher-{task}-{CACHE_VERSION}-seed{seed}`` (:func:`build_once`). Runs on: any process (plain
    function; call it before a multi-process ``fit``: the child is a 2-process run of its own)."""

    def build(tmp: str) -> str:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_RLHF_RUN", "LOCAL_RANK", "NODE_RANK"))
        }
        command = [sys.executable, "-m", "lightning_rlhf.demo", "--task", task]
        command += ["--seed", str(seed), "--cache", cache_dir, "--out", tmp]
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the demo's teacher run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        run = proc.stdout.strip().splitlines()[-1].removeprefix("run folder: ")
        return os.path.join(run, "actor")

    return build_once(cache_dir, f"demo-teacher-{task}-{CACHE_VERSION}-seed{seed}", build)


TOOL_WARM_START_STEPS = 150
"""Supervised steps of the tool task's warm start (batches of 32 transcripts)."""


def prepare_tool_model(cache_dir: str, *, seed: int = 0, warm_start_steps: int = TOOL_WARM_START_STEPS) -> str:
    """The tool task's warm-started model (:mod:`lightning_rlhf.demo.tool_task`), built and cached on first use like
    :func:`prepare_demo_model`: a tiny model saved with the tool template
    (:data:`~lightning_rlhf.demo.tool_task.TOOL_CHAT_TEMPLATE`), then ``warm_start_steps`` SFT steps on the training
    prompts' transcripts with and without the tool. Cached in
    ``cache_dir/tool-model-{CACHE_VERSION}-seed{seed}-ws{warm_start_steps}``. Runs on: any process (plain function; call
    it before a multi-process ``fit``)."""
    from lightning_rlhf.demo.tool_task import TOOL_CHAT_TEMPLATE

    def build(tmp: str) -> str:
        base = save_tiny(os.path.join(tmp, "base"), seed=seed)
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
        tokenizer.save_pretrained(base)
        return warm_start(
            base, os.path.join(tmp, "model"), steps=warm_start_steps, seed=seed, task="tools", batch_size=32
        )

    return build_once(cache_dir, f"tool-model-{CACHE_VERSION}-seed{seed}-ws{warm_start_steps}", build)


VISION_WARM_START_STEPS = 40
"""Supervised steps of the visual task's warm start (batches of 16 questions without their images: the format only)."""


def prepare_vision_model(cache_dir: str, *, seed: int = 0, warm_start_steps: int = VISION_WARM_START_STEPS) -> str:
    """The visual task's warm-started tiny VLM (:mod:`lightning_rlhf.demo.vision_task`), built and cached on first use
    like :func:`prepare_demo_model`: a tiny Qwen2-VL and its processor
    (:func:`~lightning_rlhf.demo.tiny_vlm.save_tiny_vlm`), then ``warm_start_steps`` supervised steps that teach the
    answer format with answers drawn at random (:func:`~lightning_rlhf.demo.vision_task.warm_start_vision`). Cached in
    ``cache_dir/vision-model-{CACHE_VERSION}-seed{seed}-ws{warm_start_steps}``. Runs on: any process (plain function;
    call it before a multi-process ``fit``)."""
    from lightning_rlhf.demo.tiny_vlm import save_tiny_vlm
    from lightning_rlhf.demo.vision_task import warm_start_vision

    def build(tmp: str) -> str:
        base = save_tiny_vlm(os.path.join(tmp, "base"), seed=seed)
        return warm_start_vision(base, os.path.join(tmp, "model"), steps=warm_start_steps, seed=seed)

    return build_once(cache_dir, f"vision-model-{CACHE_VERSION}-seed{seed}-ws{warm_start_steps}", build)


def tiny_vision_model(cache_dir: str) -> str:
    """The embedded model ``lightning-rlhf/tiny-vision``: :func:`prepare_vision_model` with seed 0. Runs on: any
    process (what :func:`lightning_rlhf.config.models.resolve_model_path` calls)."""
    return prepare_vision_model(cache_dir, seed=0)


def tiny_addition_model(cache_dir: str) -> str:
    """The embedded model ``lightning-rlhf/tiny-addition``: :func:`prepare_demo_model` with seed 0. Runs on: any
    process (what :func:`lightning_rlhf.config.models.resolve_model_path` calls)."""
    return prepare_demo_model(cache_dir, seed=0)


def tiny_random_model(cache_dir: str) -> str:
    """The embedded model ``lightning-rlhf/tiny-random``: the demo's tiny model untrained (:func:`save_tiny`, seed
    0), cached in ``cache_dir/tiny-random-{CACHE_VERSION}-seed0``; concurrent callers share one copy. Runs on: any
    process (what :func:`lightning_rlhf.config.models.resolve_model_path` calls)."""
    return build_once(
        cache_dir, f"tiny-random-{CACHE_VERSION}-seed0", lambda tmp: save_tiny(os.path.join(tmp, "model"), seed=0)
    )


def tiny_tools_model(cache_dir: str) -> str:
    """The embedded model ``lightning-rlhf/tiny-tools``: :func:`prepare_tool_model` with seed 0. Runs on: any
    process (what :func:`lightning_rlhf.config.models.resolve_model_path` calls)."""
    return prepare_tool_model(cache_dir, seed=0)


def _accuracy(model_dir: str, data: Any, repeats: int = 1, *, temperature: float | None = None, seed: int = 0) -> float:
    """Mean :func:`addition_reward` of the model's completions (up to 4 new tokens, cut at EOS) of ``data``'s
    prompts, each ``repeats`` times: sampled at ``temperature`` with ``seed`` (the global RNG state is left
    untouched), greedy when it is None."""
    model, tokenizer = _load(model_dir)
    prompts, answers = list(data["prompt"]) * repeats, list(data["answer"]) * repeats
    enc = tokenizer(prompts, add_special_tokens=True, padding=True, return_tensors="pt")
    kwargs: dict[str, Any] = {"do_sample": temperature is not None}
    if temperature is not None:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(  # type: ignore[operator]  # nn.Module.__getattr__ hides it from mypy
            **enc, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **kwargs
        )
    assert isinstance(out, torch.Tensor)
    responses = out[:, enc["input_ids"].shape[1] :].tolist()
    completions: list[str] = []
    for ids in responses:
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id)]
        completions.append(str(tokenizer.decode(ids, skip_special_tokens=True)))
    rewards = addition_reward(prompts, completions, answer=answers)
    return sum(rewards) / len(rewards)


def sampled_accuracy(
    model_dir: str, *, num_samples: int = 8, temperature: float = 1.0, seed: int = 0, digits: int = 1
) -> float:
    """Mean exact-match reward (in ``[0, 1]``) of sampled completions over the 100 addition prompts
    (:func:`addition_dataset` of ``digits``) of the model in ``model_dir``.

    Each prompt is sampled ``num_samples`` times with ``model.generate`` (left padding, up to 4 new tokens, stopping at
    EOS, plain temperature sampling with ``seed``) and scored with :func:`addition_reward`. The global RNG state is left
    untouched. Runs on: any process (plain function)."""
    data = addition_dataset(seed=seed, digits=digits)
    return _accuracy(model_dir, data, num_samples, temperature=temperature, seed=seed)


def held_out_accuracy(model_dir: str, *, seed: int = 0) -> float:
    """Mean exact-match reward of greedy completions over the addition task's held-out prompts
    (:func:`addition_splits`' ``"test"``, the demo's ``val/score/mean`` prompts) of the model in ``model_dir``. Runs on:
    any process (plain function)."""
    return _accuracy(model_dir, addition_splits(seed=seed)["test"])


def greedy_accuracy(model_dir: str, *, digits: int = 1) -> float:
    """Mean exact-match reward (in ``[0, 1]``) of greedy completions over the 100 addition prompts
    (:func:`addition_dataset` of ``digits``) of the model in ``model_dir``. Runs on: any process (plain function)."""
    return _accuracy(model_dir, addition_dataset(digits=digits))


def tool_success(
    model_dir: str, rows: Any, *, with_tool: bool = True, max_turns: int = 3, max_new_tokens: int = 96
) -> dict[str, float]:
    """Greedy episodes of the tool task on ``rows`` (a dataset with ``prompt`` and ``answer``) with the transformers
    engine in this process: ``success`` (share of exact final answers), ``tool_calls`` (calls per episode) and ``turns``
    (per episode). ``with_tool=False`` runs the same model without the tool
    (:class:`~lightning_rlhf.demo.tool_task.NoToolEnvironment`: no tools line in the prompt, one turn). Runs on: one
    process (rank 0 of the demo, before and after RL; the episodes are the rollout's own code)."""
    from lightning_rlhf.agents.rollout import EpisodeRunner
    from lightning_rlhf.config import EpisodeConfig, RolloutConfig
    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.demo.tool_task import CalculatorEnvironment, NoToolEnvironment
    from lightning_rlhf.engines.rollout import SamplingParams
    from lightning_rlhf.engines.rollout.hf import HFRolloutEngine

    model, tokenizer = _load(model_dir)
    engine = HFRolloutEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        device=torch.device("cpu"),
        decode_loop=CPULayer().decode_loop(),  # as the demo's CPU run samples
    )
    cfg = RolloutConfig(max_new_tokens=max_new_tokens, episode=EpisodeConfig(max_turns=max_turns, tool_workers=1))
    runner = EpisodeRunner(CalculatorEnvironment if with_tool else NoToolEnvironment, tokenizer, cfg)
    params = SamplingParams(greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    try:
        episodes, _, _ = runner.run(engine, [dict(row) for row in rows], params)
    finally:
        runner.close()
    scores = [ep.env.reward(ep.info) or 0.0 for ep in episodes]
    count = max(1, len(episodes))
    return {
        "success": sum(scores) / count,
        "tool_calls": sum(ep.info.tool_calls for ep in episodes) / count,
        "turns": sum(ep.info.turns for ep in episodes) / count,
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_rlhf.demo.warmstart MODEL OUT``: one warm start in this process (what
    :func:`warm_start` runs in its child); prints the loss line last. Runs on: one process."""
    parser = argparse.ArgumentParser(prog="python -m lightning_rlhf.demo.warmstart", description=main.__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, default=1)
    parser.add_argument("--task", choices=["addition", "tools"], default="addition")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    loss = _warm_start_here(**vars(args))
    print(f"SFTModule: {loss['steps']:.0f} steps, sft/loss {loss['first']:.3f} -> {loss['last']:.3f}", flush=True)


if __name__ == "__main__":
    main()
