"""The actor update at Qwen3-0.6B's width against a plain PyTorch forward+backward of the same model and tokens.

    python benchmarks/bench_update_width.py                      # 3 rounds, actor and plain alternating
    python benchmarks/bench_update_width.py --rounds 1 --profile # and a torch.profiler op table of each, rank 0
    python benchmarks/bench_update_width.py --modes actor --alt-micro-batch-size 16  # and micro-batches of 16
    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/bench_update_width.py --family qwen2.5-0.5b --layers 8 \
        --rows 8 --prompt 66 --response 512 --micro-batch-size 2 --activation-checkpointing --no-before \
        --plain-adamw fused --plain-drop-adamw-state --rounds 2 --repeats 1   # the real run's workload, 8 layers

Model: Qwen3-0.6B's published configuration cut to 2 layers (vocabulary 151,936, tied; 187M parameters, random
weights, float32; ``bench_handoff.build``). Two processes (torchrun, gloo, one thread each), 32 samples of 10 prompt +
32 response tokens, every sample with a non-zero advantage, 16 rows per rank.

- ``actor``: :meth:`ActorRole.update` as a run does it: FSDP2 over both ranks, the CPU layer on, default settings
  (micro-batch 8, ``reshard_in_update`` on, AdamW with gradient clipping); in the same processes, alternating
  update by update, ``before``: the same with the root unit gathered and reduced per micro-batch (the CPU layer's
  ``keeps_root_in_update`` off, as before it existed).
- ``plain``: the transformers model whole on each rank (no FSDP, no layer), its 16 rows in one forward, loss =
  cross-entropy of the response tokens, ``backward``; then (timed apart) ``torch.optim.AdamW`` with ``foreach``,
  and an ``all_reduce`` of the gradients as plain DDP would (timed apart, over gloo).

Each mode runs in its own pair of processes (both in one would not fit a shared 24 GiB machine), the pairs
alternating ``--rounds`` times; a pair does one warm-up and ``--repeats`` timed calls. Medians over all timed calls.
MFU = ``training_flops(params, tokens) / seconds / (2 x cpu_matmul_peak(float32))`` (one thread per rank).

Other models and workloads: ``--family NAME --layers N`` builds a family model of
:mod:`lightning_rlhf.demo.families` (random weights, float32) instead; ``--rows``, ``--prompt`` and ``--response``
set the batch (all ranks together); ``--micro-batch-size`` sets the actor's micro-batch and makes plain accumulate
gradients over micro-batches of the same rows (default: the actor's default, plain in one forward);
``--activation-checkpointing`` checkpoints every decoder layer on both sides (the actor's
``TrainEngine.activation_checkpointing``, as ``RLHFModule(activation_checkpointing=True)`` sets it; plain:
transformers' ``gradient_checkpointing_enable`` with the non-reentrant checkpoint). MFU counts the model FLOPs
(6 N T) without the recompute on both sides. ``--no-before`` times the actor as it is only; ``--plain-adamw
fused`` gives plain the fused AdamW (the actor's form, no model-sized temporaries); ``--plain-micro-batch-size``
plain's own micro-batch; ``--plain-drop-adamw-state`` frees plain's AdamW state after each step (where the whole
model's gradients, AdamW state and activations do not fit together). The warm-up call is the first micro-batch's
rows only (it compiles, allocates and creates the optimizer state; a whole update at a real length
takes minutes here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

SEQS, PROMPT, RESP = 32, 10, 32


def batch_rows(rank: int, world: int, vocab: int, shape: tuple[int, int, int] = (SEQS, PROMPT, RESP)) -> Any:
    """This rank's rows of the fixed rollout batch of ``shape`` = (samples, prompt tokens, response tokens), the
    same tokens for both modes. Runs on: each rank."""
    from lightning_rlhf.batch import Batch

    seqs, prompt, resp = shape

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (seqs, prompt), generator=g)
    responses = torch.randint(4, vocab, (seqs, resp), generator=g)
    adv = torch.randn(seqs, generator=g).sign()  # +-1: every sample trains
    full = Batch(
        {
            "prompts": prompts,
            "prompt_mask": torch.ones(seqs, prompt, dtype=torch.long),
            "responses": responses,
            "response_mask": torch.ones(seqs, resp, dtype=torch.long),
            "advantages": adv.reshape(seqs, 1).expand(seqs, resp).contiguous(),
        }
    )
    per = seqs // world
    return full.select(list(range(rank * per, (rank + 1) * per)))


def actor_calls(
    path: str,
    batch: Any,
    alt_micro: int = 0,
    *,
    micro: int = 0,
    checkpointing: bool = False,
    before: bool = True,
    response: int = RESP,
) -> tuple[Any, dict[str, Any]]:
    """The actor role, sharded as the strategy shards it; its update, timed as it is now (``actor``) and, with
    ``before``, as it was (``before``: the root unit gathered and reduced per micro-batch), alternating in the same
    processes. ``micro``: its micro-batch size (0: the default); ``checkpointing``: every decoder layer checkpointed.
    Runs on: each rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig
    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.roles import ActorRole

    actor = ActorRole(
        path,
        tokenizer=AutoTokenizer.from_pretrained(path),
        rollout=RolloutConfig(n=8, max_new_tokens=response),
        algorithm=AlgorithmConfig(),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
    )
    actor.load()
    actor.train_engine.activation_checkpointing = checkpointing  # as RLHFModule sets it, before sharding
    if micro:
        actor.train_engine.micro_batch_size = micro
    layer = CPULayer()
    actor.train_engine.layer = layer
    actor.train_engine.shard(init_device_mesh("cpu", (dist.get_world_size(),)), param_dtype=None)
    actor.train_engine.materialize(torch.device("cpu"))
    actor.configure_optimizer(total_steps=1000)
    params = sum(p.numel() for p in actor.model.parameters())  # DTensors: the full count
    keeps, default_micro = layer.keeps_root_in_update, actor.train_engine.micro_batch_size

    def update(before: bool, micro: int = 0, rows: Any = batch) -> float:
        layer.keeps_root_in_update = (lambda: False) if before else keeps  # type: ignore[method-assign]
        actor.train_engine.micro_batch_size = micro or default_micro
        dist.barrier()
        return _timed(lambda: actor.update(rows))

    calls = [0]

    def call() -> dict[str, float]:  # both, in turn first
        calls[0] += 1
        order = ((True, False) if calls[0] % 2 else (False, True)) if before else (False,)
        times = {("before" if b else "actor"): update(b) for b in order}
        if alt_micro:  # and the update as now with another micro-batch size
            times[f"micro{alt_micro}"] = update(False, alt_micro)
        return times | {"total": times["actor"]}

    call.profiled = lambda: update(False)  # type: ignore[attr-defined]
    call.warm = lambda: update(False, rows=batch.select(list(range(default_micro))))  # type: ignore[attr-defined]
    return call, {"params": params}


def plain_calls(
    path: str,
    batch: Any,
    *,
    micro: int = 0,
    checkpointing: bool = False,
    adamw: str = "foreach",
    drop_state: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """The same model whole, a plain forward+backward of cross-entropy on the response tokens, over micro-batches of
    ``micro`` rows (0: all in one), gradients accumulated; ``checkpointing``: transformers' non-reentrant gradient
    checkpointing of every decoder layer; ``adamw``: ``torch.optim.AdamW``'s ``foreach`` or ``fused`` form (the
    fused one holds no temporaries of the model's size); ``drop_state``: AdamW's state dropped after each step (it
    and the activations never live together; each step then creates it, as a first step does). Runs on: each rank."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, **{adamw: True})
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    labels = batch["responses"]
    prompt, rows = batch["prompts"].shape[1], ids.shape[0]
    keep = torch.arange(prompt - 1, ids.shape[1] - 1)  # the positions that predict the response tokens
    size = micro or rows

    def fwd_bwd(n: int) -> tuple[float, float]:  # the first n rows, micro-batch by micro-batch
        fwd = bwd = 0.0
        for i in range(0, n, size):
            t0 = time.perf_counter()
            logits = model(input_ids=ids[i : i + size], logits_to_keep=keep).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[i : i + size].reshape(-1)
            ) * (min(size, n - i) / n)
            t1 = time.perf_counter()
            del logits  # cross-entropy keeps its log-softmax: the logits need not live through the backward
            loss.backward()
            del loss
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
        return fwd, bwd

    def call(n: int = rows) -> dict[str, float]:
        t0 = time.perf_counter()
        fwd = fwd_bwd(n)[0]
        t1, t2 = t0 + fwd, time.perf_counter()
        for p in model.parameters():  # DDP's gradient all-reduce, one tensor at a time (no buckets)
            dist.all_reduce(p.grad)
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if drop_state:
            opt.state.clear()
        t4 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "fwd_bwd": t2 - t0, "all_reduce": t3 - t2, "step": t4 - t3}

    call.warm = lambda: call(size)  # type: ignore[attr-defined]
    return call, {"params": sum(p.numel() for p in model.parameters())}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    """One rank of one mode: warm-up, timed calls, optionally a profile; rank 0 writes the JSON. Runs on: torchrun."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.worker).vocab_size
    batch = batch_rows(rank, world, vocab, (args.rows, args.prompt, args.response))
    micro, ckpt = args.micro_batch_size, args.activation_checkpointing
    if args.mode == "plain":
        plain_micro = args.plain_micro_batch_size or micro
        call, info = plain_calls(
            args.worker,
            batch,
            micro=plain_micro,
            checkpointing=ckpt,
            adamw=args.plain_adamw,
            drop_state=args.plain_drop_adamw_state,
        )
    else:
        call, info = actor_calls(
            args.worker,
            batch,
            args.alt_micro_batch_size,
            micro=micro,
            checkpointing=ckpt,
            before=args.before,
            response=args.response,
        )
    call.warm()  # warm-up: the first micro-batch's rows
    runs = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        parts = call()
        runs.append({"total": time.perf_counter() - t0} | parts)
    table = ""
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.profile_shapes) as prof:
            getattr(call, "profiled", call)()
        averages = prof.key_averages(group_by_input_shape=args.profile_shapes)
        table = averages.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "hwm_mib": hwm / 1024, "profile": table} | info, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(path: str, mode: str, args: argparse.Namespace, out: str) -> dict[str, Any]:
    """One pair of processes of ``mode``. Runs on: the launcher."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    cmd += ["--worker", path, "--mode", mode, "--repeats", str(args.repeats), "--out", out]
    cmd += ["--alt-micro-batch-size", str(args.alt_micro_batch_size), "--micro-batch-size", str(args.micro_batch_size)]
    cmd += ["--rows", str(args.rows), "--prompt", str(args.prompt), "--response", str(args.response)]
    cmd += ["--plain-adamw", args.plain_adamw, "--plain-micro-batch-size", str(args.plain_micro_batch_size)]
    cmd += ["--plain-drop-adamw-state"] if args.plain_drop_adamw_state else []
    cmd += ["--activation-checkpointing"] if args.activation_checkpointing else []
    cmd += [] if args.before else ["--no-before"]
    cmd += ["--profile", "--profile-rows", str(args.profile_rows)] if args.profile else []
    cmd += ["--profile-shapes"] if args.profile_shapes else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"{mode} worker failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    """Parses the arguments; builds the model; alternates the modes; prints the table. Runs on: the launcher."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["actor", "plain"], choices=["actor", "plain"])
    p.add_argument("--alt-micro-batch-size", type=int, default=0, help="also time the actor with this micro-batch")
    p.add_argument("--family", help="a family model of lightning_rlhf.demo.families (default: Qwen3-0.6B's width)")
    p.add_argument("--layers", type=int, default=None, help="the family model's layers (default: its cut)")
    p.add_argument("--rows", type=int, default=SEQS, help="samples, all ranks together")
    p.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens a sample")
    p.add_argument("--response", type=int, default=RESP, help="response tokens a sample")
    p.add_argument("--micro-batch-size", type=int, default=0, help="rows a micro-batch, both modes (0: defaults)")
    p.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every layer, both modes")
    p.add_argument("--plain-adamw", choices=["foreach", "fused"], default="foreach", help="plain's AdamW form")
    p.add_argument("--plain-micro-batch-size", type=int, default=0, help="plain's own (0: --micro-batch-size)")
    p.add_argument("--plain-drop-adamw-state", action="store_true", help="plain's AdamW state only during a step")
    p.add_argument("--no-before", dest="before", action="store_false", help="skip the actor's old root handling")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-rows", type=int, default=30)
    p.add_argument("--profile-shapes", action="store_true", help="the op table by input shapes")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from bench_handoff import build

    from lightning_rlhf.perf import cpu_matmul_peak, training_flops

    torch.set_num_threads(1)
    peak = cpu_matmul_peak(torch.float32)
    folder = os.path.join(tempfile.gettempdir(), "lightning_rlhf_bench_models")
    if args.family:
        from lightning_rlhf.demo.families import build_family

        name = f"update-{args.family}-{args.layers or 'cut'}"
        path = os.path.join(folder, name)
        if not os.path.isfile(os.path.join(path, "config.json")):
            build_family(args.family, path, layers=args.layers)
    else:
        path = build(folder, "qwen3")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    info: dict[str, dict[str, Any]] = {}
    for r in range(args.rounds):
        for mode in args.modes:
            res = launch(path, mode, args, os.path.join(folder, f"update-{mode}-{os.getpid()}.json"))
            runs[mode] += res["runs"]
            info[mode] = res
            print(f"# round {r} {mode}: {[round(x['total'], 2) for x in res['runs']]} s", file=sys.stderr, flush=True)
    tokens = args.rows * (args.prompt + args.response)
    print(
        f"\n{args.rows} samples x ({args.prompt} + {args.response}) tokens, micro-batch "
        f"{args.micro_batch_size or 'default'}, checkpointing {'on' if args.activation_checkpointing else 'off'}, "
        f"2 ranks x 1 thread, peak {peak / 1e9:.0f} GFLOP/s per rank"
    )
    print("| mode | median s (min-max) | parts (median s) | MFU | peak RSS rank 0 MiB |")
    print("| --- | ---: | --- | ---: | ---: |")
    summary = {}
    for mode, rows in runs.items():
        if not rows:  # --repeats 0: a profile only
            continue
        total = statistics.median(x["total"] for x in rows)
        parts = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "total"}
        m = training_flops(info[mode]["params"], tokens) / total / (2 * peak)
        summary[mode] = {"total": total, "mfu": m, "parts": parts, "hwm_mib": info[mode]["hwm_mib"]}
        lo, hi = min(x["total"] for x in rows), max(x["total"] for x in rows)
        text = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
        print(f"| {mode} | {total:.2f} ({lo:.2f}-{hi:.2f}) | {text} | {m:.3f} | {info[mode]['hwm_mib']:.0f} |")
    if "actor" in summary and "plain" in summary:
        actor, plain = summary["actor"], summary["plain"]
        if "before" in actor["parts"]:
            old = actor["parts"]["before"]
            print(f"actor MFU {actor['mfu']:.3f} (before: {old:.2f} s, MFU {actor['mfu'] * actor['total'] / old:.3f})")
        print(
            f"actor / plain: {actor['total'] / plain['total']:.2f}x the plain step (forward, backward, all-reduce, "
            f"AdamW), {actor['total'] / plain['parts']['fwd_bwd']:.2f}x its forward+backward"
        )
    if args.profile:
        for mode in args.modes:
            print(f"\n## {mode}: torch.profiler, one call, rank 0\n{info[mode]['profile']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
