"""One actor update (forward + backward + optimizer step), before and after each lever of the update forward.

    python benchmarks/bench_update.py                       # tiny and small, every lever, micro-batch 128
    python benchmarks/bench_update.py --models small --micro-batch-size 8 --configs baseline all

Workload (issue 11): 128 sequences of 10 prompt + 64 response tokens (no padding), temperature 1, group-normalised
advantages (16 groups of 8), on-policy (no ``old_logprobs``), token-mean loss, clip 0.2, ``entropy_coef=0``,
AdamW lr 1e-6, grad clip 1, float32, one process. The update is :meth:`ActorRole.update` itself; only the
function it calls for the forward (``forward_response``) is swapped per configuration:

- ``baseline``: the forward as it was (logits of R + 1 positions, the last dropped, ``.float() / temperature``
  always, ``logsumexp`` over the full tensor, entropy through ``softmax`` with its gradient);
- ``entropy_nograd``: baseline, but the entropy computed without gradient (``entropy_coef`` is 0);
- ``no_temp_copy``: baseline, but no division (a full copy) at temperature 1;
- ``chunked``: block-wise log-probs/entropy (``logprobs_and_entropy``) with the entropy still differentiable
  (at temperature 1 this includes the no-copy lever: blocks are used as they are);
- ``all``: today's ``forward_response`` (block-wise, entropy without gradient at ``entropy_coef=0``).

Models, built locally: ``tiny`` (``save_tiny`` defaults: hidden 128, 2 layers, vocabulary 512) and ``small``
(hidden 256, 4 layers, 4/2 heads, head_dim 64, MLP 704, vocabulary 4,096, tied; 4.0M parameters).
Peak RSS: each configuration in a fresh process of its own (one warm-up and one update). Times: all
configurations in one process, alternating update by update (so a busy moment of a shared machine hits them
alike): ``--warmup`` untimed rounds, then the median of ``--repeats``. Forward = time inside the actor's
forward (model + log-probs + loss), backward = time inside ``Tensor.backward``, step = the engine's clip +
AdamW step + zero_grad. Prints a markdown table and, as its last line, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import Tensor

CONFIGS = ("baseline", "entropy_nograd", "no_temp_copy", "chunked", "all")


# ----------------------------------------------------------------------------------------------- models
def build_models(root: str, names: list[str]) -> dict[str, str]:
    """Saves the requested models (and the tiny byte-level BPE tokenizer) under ``root``. Runs on: the parent."""
    from bench_models import save_qwen2  # benchmarks/bench_models.py

    from lightning_rlhf.demo.tiny import save_tiny

    paths: dict[str, str] = {}
    for name in names:
        path = os.path.join(root, name)
        if name == "tiny":
            paths[name] = save_tiny(path, seed=0)
        elif name == "small":
            paths[name] = save_qwen2(
                path,
                vocab_size=4096,
                max_positions=128,
                hidden_size=256,
                intermediate_size=704,
                num_hidden_layers=4,
                head_dim=64,
            )
        else:
            raise SystemExit(f"--models: unknown model {name!r}. HINT: choose from tiny, small.")
    return paths


# ------------------------------------------------------------------------------------ the old forward
def _legacy_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """The former ``logprobs_from_logits`` on float32 input: gather minus a full-tensor ``logsumexp``."""
    return logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _legacy_entropy(logits: Tensor) -> Tensor:
    """The former ``entropy_from_logits`` on float32 input: a full ``softmax``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def legacy_forward(*, entropy_lever: bool, temperature_lever: bool) -> Callable[..., dict[str, Tensor]]:
    """The forward as it was before the levers, with the two simple levers switchable. Runs on: the child."""
    from lightning_rlhf.engines.train import sequence_inputs

    def forward(
        model: torch.nn.Module,
        batch: Any,
        *,
        output: Literal["logprobs", "values"],
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> dict[str, Tensor]:
        assert output == "logprobs"
        device = next(model.parameters()).device
        input_ids, attention_mask, position_ids = sequence_inputs(batch, device)
        resp_len = batch["responses"].shape[1]
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=resp_len + 1,
        ).logits[:, :-1]
        logits = logits.float()
        if not (temperature_lever and temperature == 1.0):
            logits = logits / temperature
        out = {"logprobs": _legacy_logprobs(logits, input_ids[:, -resp_len:])}
        if with_entropy:
            no_grad = entropy_lever and not entropy_grad
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                out["entropy"] = _legacy_entropy(logits)
        return out

    return forward


def forward_for(config: str) -> Callable[..., dict[str, Tensor]]:
    """The forward function of one configuration. Runs on: the child."""
    from lightning_rlhf.engines.train import forward_response

    if config == "baseline":
        return legacy_forward(entropy_lever=False, temperature_lever=False)
    if config == "entropy_nograd":
        return legacy_forward(entropy_lever=True, temperature_lever=False)
    if config == "no_temp_copy":
        return legacy_forward(entropy_lever=False, temperature_lever=True)
    if config == "chunked":
        return lambda *a, **kw: forward_response(*a, **(kw | {"entropy_grad": True}))
    if config == "all":
        return forward_response
    raise SystemExit(f"--configs: unknown configuration {config!r}. HINT: choose from {', '.join(CONFIGS)}.")


# -------------------------------------------------------------------------------------------- the child
def rollout_batch(seqs: int, prompt_len: int, resp_len: int, group: int, vocab: int) -> Any:
    """A fixed-length rollout batch with group-normalised advantages. Runs on: the child."""
    from lightning_rlhf.batch import Batch

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (seqs // group, group), generator=g).float()
    adv = (scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-4)
    return Batch(
        {
            "prompts": torch.randint(4, vocab, (seqs, prompt_len), generator=g),
            "prompt_mask": torch.ones(seqs, prompt_len, dtype=torch.long),
            "responses": torch.randint(4, vocab, (seqs, resp_len), generator=g),
            "response_mask": torch.ones(seqs, resp_len, dtype=torch.long),
            "advantages": adv.reshape(seqs, 1).expand(seqs, resp_len).contiguous(),
        }
    )


def child(args: argparse.Namespace) -> None:
    """Times ``ActorRole.update`` with one configuration's forward; prints one JSON line. Runs on: the child."""
    from transformers import AutoTokenizer

    import lightning_rlhf.roles.actor as actor_module
    from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig
    from lightning_rlhf.roles import ActorRole

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model_path)
    actor = ActorRole(
        args.model_path,
        tokenizer=tok,
        rollout=RolloutConfig(n=8, temperature=args.temperature, max_new_tokens=args.resp_len),
        algorithm=AlgorithmConfig(micro_batch_size=args.micro_batch_size, entropy_coef=0.0),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
    )
    actor.load()
    actor.configure_optimizer(total_steps=1000)
    assert actor.model is not None
    batch = rollout_batch(args.seqs, args.prompt_len, args.resp_len, 8, min(len(tok), actor.model.config.vocab_size))

    clock: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[key] += time.perf_counter() - t0

        return wrapper

    configs = args.config.split(",")
    forwards = {config: forward_for(config) for config in configs}
    actor._policy_loss = timed("forward", actor._policy_loss)  # type: ignore[method-assign]
    actor.train_engine.step = timed("step", actor.train_engine.step)  # type: ignore[method-assign]
    torch.Tensor.backward = timed("backward", torch.Tensor.backward)  # type: ignore[method-assign]

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows: dict[str, list[dict[str, float]]] = {config: [] for config in configs}
    metrics: dict[str, Any] = {}
    for i in range(args.warmup + args.repeats):
        for config in configs:  # round-robin: a busy moment of a shared machine hits every configuration alike
            actor_module.forward_response = forwards[config]  # type: ignore[assignment]
            for key in clock:
                clock[key] = 0.0
            t0 = time.perf_counter()
            metrics = actor.update(batch)
            total = time.perf_counter() - t0
            if i >= args.warmup:
                rows[config].append(clock | {"total": total})
    results: dict[str, dict[str, Any]] = {}
    for config, runs in rows.items():
        results[config] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        results[config] |= {
            "total_min": min(r["total"] for r in runs),
            "total_max": max(r["total"] for r in runs),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_mib": rss_before,
            "threads": torch.get_num_threads(),
            "entropy": float(metrics["actor/entropy"]),
        }
    print(json.dumps(results))


# ------------------------------------------------------------------------------------------- the parent
def child_run(path: str, configs: str, extra: list[str]) -> dict[str, dict[str, Any]]:
    """Runs one child process and returns its figures per configuration. Runs on: the parent."""
    cmd = [sys.executable, __file__, "--child", "--model-path", path, "--config", configs, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{path} / {configs} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    """Parses the arguments; the parent builds the models and runs the children. Runs on: the parent."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--micro-batch-size", type=int, default=128)
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=10)
    parser.add_argument("--resp-len", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    for config in args.configs:
        if config not in CONFIGS:
            raise SystemExit(f"--configs: unknown configuration {config!r}. HINT: choose from {', '.join(CONFIGS)}.")
    if args.seqs % 8:
        raise SystemExit(f"--seqs={args.seqs} must be a multiple of 8 (groups of 8 samples).")

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_update_") as root:
        paths = build_models(root, args.models)
        passthrough = [
            *("--micro-batch-size", str(args.micro_batch_size), "--seqs", str(args.seqs)),
            *("--prompt-len", str(args.prompt_len), "--resp-len", str(args.resp_len)),
            *("--temperature", str(args.temperature), "--threads", str(args.threads)),
        ]
        repeats = ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
        for model, path in paths.items():
            for config in args.configs:  # one process each, for its own peak RSS (one warm-up, one update)
                rss = child_run(path, config, [*passthrough, "--warmup", "1", "--repeats", "1"])[config]
                results[f"{model}/{config}"] = {
                    "peak_rss_mib": rss["peak_rss_mib"],
                    "rss_before_mib": rss["rss_before_mib"],
                }
            # the times: every configuration in one process, alternating
            timing = child_run(path, ",".join(args.configs), [*passthrough, *repeats])
            for config, r in timing.items():
                for key in ("peak_rss_mib", "rss_before_mib"):  # the timing process ran them all: not its own
                    del r[key]
                results[f"{model}/{config}"] |= r
                print(f"# {model}/{config}: total {r['total']:.3f} s", file=sys.stderr, flush=True)

    print(
        f"\nactor update, {args.seqs} seqs x ({args.prompt_len} + {args.resp_len}) tokens, micro-batch "
        f"{args.micro_batch_size}, temperature {args.temperature}, median of {args.repeats} after {args.warmup} "
        "warm-ups, seconds\n"
    )
    print("| model | config | forward | backward | step | total (min-max) | peak RSS MiB (before update) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for key, r in results.items():
        model, config = key.split("/")
        print(
            f"| {model} | {config} | {r['forward']:.3f} | {r['backward']:.3f} | {r['step']:.3f} | "
            f"{r['total']:.3f} ({r['total_min']:.3f}-{r['total_max']:.3f}) | "
            f"{r['peak_rss_mib']:.0f} ({r['rss_before_mib']:.0f}) |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
