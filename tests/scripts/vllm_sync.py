"""Checks the FSDP2 -> vLLM weight hand-off; the vLLM tests launch it as a subprocess.

``--mode sync`` (under torchrun, 1 or 2 processes): shards the model with FSDP2, builds the colocated engine
with dummy weights; then, for each hand-off named in ``--transfers``: perturbs the FSDP weights (same seed on
every rank), hands them over with the actor's own path (``weights_for`` -> ``load_weights``), decodes
greedily, and compares with transformers on the same weights. Rank 0 saves the last perturbed model as a
transformers folder and writes the outputs and byte counts as JSON.

``--mode fresh`` (one process): builds a fresh engine from that saved folder and writes its greedy outputs.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.engines.rollout import SamplingParams
from lightning_rlhf.engines.rollout.reshard import weights_for
from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings
from lightning_rlhf.engines.train import full_tensors, shard_model

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 10, 11, 12], [1, 13]]
EOS = 2


def greedy(engine: VLLMRolloutEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(n=1, max_new_tokens=12, greedy=True, stop_token_ids=(EOS,))
    return engine.generate(prompts, params).responses


def hf_greedy(model: torch.nn.Module, path: str, rank: int, out: str) -> list[list[int]]:
    """Greedy decoding of the same prompts by transformers on the current weights (all ranks gather them;
    rank 0 also saves them as a transformers folder, ``<out>/perturbed``, for the fresh-engine check)."""
    state = {name: t.clone() for name, t in full_tensors(model)}
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    plain.load_state_dict(state, strict=False)
    if rank == 0:
        plain.save_pretrained(os.path.join(out, "perturbed"))
    reference = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = plain.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=0
            )[0, len(prompt) :].tolist()
            reference.append(ids[: ids.index(EOS) + 1] if EOS in ids else ids)
    return reference


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["sync", "fresh"], required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--transfers", default="slices", help="comma-separated hand-offs in order, e.g. full,slices")
    args = p.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    world, rank = 1, 0
    if args.mode == "sync":
        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    config = VLLMConfig(
        tensor_parallel_size=args.tp,
        weight_bucket_mb=args.bucket_mb,
        weight_transfer="slices",
        load_format="dummy" if args.mode == "sync" else "auto",
    )
    max_len = check_vllm_settings(
        args.model,
        config,
        dtype=torch.float32,
        device_type="cpu",
        world_size=world,
        max_prompt_length=8,
        max_new_tokens=12,
    )
    engine = VLLMRolloutEngine(
        args.model,
        param_names=[n for n, _ in model.named_parameters()],
        config=config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=max_len,
        tie_word_embeddings=model.config.tie_word_embeddings,
        hf_config=model.config,
        layer=CPULayer(),
    )
    if args.mode == "fresh":
        with open(os.path.join(args.out, "fresh.json"), "w") as f:
            json.dump({"greedy": greedy(engine, PROMPTS)}, f)
        return

    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    shard_model(model, mesh, layer=CPULayer())
    gen = torch.Generator().manual_seed(1234)
    slicer = engine.slicer
    report = {}
    for transfer in args.transfers.split(","):
        with torch.no_grad():  # perturb every sharded parameter the same way on every rank
            for _, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=gen) * 0.3
                full = param.data.full_tensor() + noise
                param.data.copy_(dist.tensor.distribute_tensor(full, mesh, param.data.placements))
        engine.slicer = slicer if transfer == "slices" else None
        received = [0]
        handed = engine.load_weights(weights_for(engine, model, received, layer=CPULayer()))
        # every rank decodes all prompts (at TP=2 each rank brings half and the engine gathers them)
        mine = PROMPTS if args.tp == 1 else PROMPTS[rank * 2 : rank * 2 + 2]
        out = greedy(engine, mine)
        if args.tp > 1:
            parts: list[list[list[int]]] = [[] for _ in range(world)]
            dist.all_gather_object(parts, out)
            out = [r for part in parts for r in part]
        report[transfer] = {"greedy": out, "handed": handed, "received": received[0]}
        report[transfer]["hf_greedy"] = hf_greedy(model, args.model, rank, args.out)
        if rank == 0:
            print(transfer, report[transfer], flush=True)
    if rank == 0:
        with open(os.path.join(args.out, "sync.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()  # the process group stays up: vLLM tears its groups down at exit


if __name__ == "__main__":
    main()
