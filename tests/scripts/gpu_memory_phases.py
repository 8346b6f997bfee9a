"""Measures the device memory of one rollout's phases with a colocated vLLM engine on a GPU; the GPU tests launch it
under torchrun (one process).

An FSDP2 actor (bfloat16 compute, float32 master weights) of a ~570M-parameter random Qwen2 model and a vLLM engine
(``load_format="dummy"``, a fixed KV cache) on one GPU: one rollout and one update, then the measured rollout.
Each call on the engine (``wake_up``, ``load_weights``, ``generate``, ``sleep``) and the actor's
``release_device_memory`` is wrapped to record the device's used memory (the driver's view: vLLM's sleep-mode
allocator is outside PyTorch's statistics) before and after it, and a thread samples it from the first release to
the end of ``sleep`` for the peak.

Writes ``<out>/memory_phases.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, BatchingConfig, OptimConfig, RolloutConfig, VLLMConfig
from lightning_rlhf.demo import save_tiny
from lightning_rlhf.engines.rollout.base import tied_aliases
from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings
from lightning_rlhf.roles import ActorRole

KV_BYTES = 1 << 30
BUCKET_MB = 64.0


def used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


class PeakSampler:
    """Samples the device's used memory on a thread between :meth:`start` and :meth:`stop`; ``peak`` is the largest
    sample (and the readings at both ends)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, used_bytes())

    def start(self) -> None:
        self.peak = used_bytes()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, used_bytes())


def record(phases: list[dict[str, Any]], owner: Any, name: str, label: Any, sampler: PeakSampler) -> None:
    """Wrap ``owner.name`` to append its phase's readings to ``phases``; the sampler runs from the end of the first
    phase (the trainer's release: the floor) to the end of ``sleep`` (the optimizer's onload afterwards is not a
    rollout phase)."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        before = used_bytes()
        out = real(*args, **kwargs)
        torch.cuda.synchronize()
        phase = label(*args, **kwargs)
        phases.append(
            {
                "phase": phase,
                "used_before": before,
                "used_after": used_bytes(),
                "torch_cached_after": int(torch.cuda.memory_reserved() - torch.cuda.memory_allocated()),
            }
        )
        if len(phases) == 1:
            sampler.start()
        if phase == "sleep":
            sampler.stop()
        return out

    setattr(owner, name, recorded)


def prompts(tok: Any, count: int) -> Batch:
    ids = [tok(f"{i}+{i + 3}=")["input_ids"] for i in range(count)]
    width = max(len(p) for p in ids)
    rows = torch.full((count, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((count, width), dtype=torch.long)
    for i, p in enumerate(ids):
        rows[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return Batch({"prompts": rows, "prompt_mask": mask, "uid": torch.arange(count)})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sleep-level", type=int, default=1)
    args = p.parse_args()

    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    path = save_tiny(
        os.path.join(args.out, "model"), hidden_size=2048, num_layers=12, num_heads=16, num_kv_heads=8,
        intermediate_size=5632,
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(path)
    actor = ActorRole(
        path,
        tokenizer=tok,
        rollout=RolloutConfig(n=4, max_new_tokens=32),
        algorithm=AlgorithmConfig(batching=BatchingConfig(micro_batch_size=8)),
        optim=OptimConfig(lr=1e-6),
    )
    actor.load()
    assert actor.model is not None
    mesh = dist.device_mesh.init_device_mesh("cuda", (dist.get_world_size(),))
    actor.shard(mesh, param_dtype=torch.bfloat16)
    actor.train_engine.materialize(device)
    actor.configure_optimizer(total_steps=10)
    config = VLLMConfig(
        sleep_level=args.sleep_level,  # type: ignore[arg-type]
        kv_cache_memory_bytes=KV_BYTES,
        weight_bucket_mb=BUCKET_MB,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
    )
    max_len = check_vllm_settings(
        path, config, dtype=torch.bfloat16, device_type="cuda", world_size=1, max_prompt_length=16, max_new_tokens=32
    )
    names = [n for n, _ in actor.model.named_parameters()]
    hf_config: Any = actor.model.config
    engine = VLLMRolloutEngine(
        path,
        param_names=names,
        config=config,
        dtype=torch.bfloat16,
        device=device,
        max_model_len=max_len,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        hf_config=hf_config,
        eos_token_id=tok.eos_token_id,
        tied_names=tied_aliases(actor.model),
    )
    actor.attach_engine(engine)
    batch = prompts(tok, 16)

    rollout = actor.generate(batch)  # the first hand-off (dummy weights), then one update: the trainer's state
    mask = rollout["response_mask"]
    rollout["advantages"] = torch.randn(len(rollout), 1).expand_as(mask) * mask
    actor.update(rollout)

    phases: list[dict[str, Any]] = []
    sampler = PeakSampler()
    record(phases, engine, "wake_up", lambda tags=None: "wake:" + ("all" if tags is None else "+".join(tags)), sampler)
    record(phases, engine, "load_weights", lambda *a, **k: "handoff", sampler)
    record(phases, actor.hybrid, "release_device_memory", lambda: "release", sampler)
    record(phases, engine, "generate", lambda *a, **k: "generate", sampler)
    record(phases, engine, "sleep", lambda: "sleep", sampler)
    torch.cuda.synchronize()
    idle = used_bytes()
    actor.generate(batch)
    engine_weight_bytes = sum(p.numel() for p in actor.model.parameters()) * torch.bfloat16.itemsize
    locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in actor.model.parameters()]
    shard_bytes = sum(t.numel() * t.element_size() for t in locals_)
    report = {
        "device": torch.cuda.get_device_name(device),
        "sleep_level": args.sleep_level,
        "idle_used": idle,
        "peak_used": max(sampler.peak, *(ph["used_after"] for ph in phases)),
        "engine_weight_bytes": engine_weight_bytes,
        "actor_shard_bytes": shard_bytes,
        "kv_cache_bytes": KV_BYTES,
        "bucket_bytes": int(BUCKET_MB * (1 << 20)),
        "phases": phases,
    }
    print(json.dumps(report, indent=1), flush=True)
    with open(os.path.join(args.out, "memory_phases.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()


if __name__ == "__main__":
    main()
