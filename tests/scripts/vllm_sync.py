"""Checks the FSDP2 -> vLLM weight hand-off; the vLLM tests launch it as a subprocess.

``--mode sync`` (under torchrun, 1 or 2 processes): shards the model with FSDP2, builds the colocated engine
with dummy weights, perturbs the FSDP weights (same seed on every rank), hands them over with the actor's own
path (``full_tensors`` -> ``load_weights``), then decodes greedily. Rank 0 saves the perturbed model as a
transformers folder and writes the engine's and transformers' greedy outputs as JSON.

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
from lightning_rlhf.engines.rollout import SamplingParams
from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings
from lightning_rlhf.engines.train import full_tensors, shard_model

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 10, 11, 12], [1, 13]]
EOS = 2


def greedy(engine: VLLMRolloutEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(n=1, max_new_tokens=12, greedy=True, stop_token_ids=(EOS,))
    return engine.generate(prompts, params).responses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["sync", "fresh"], required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=256.0)
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
    )
    if args.mode == "fresh":
        with open(os.path.join(args.out, "fresh.json"), "w") as f:
            json.dump({"greedy": greedy(engine, PROMPTS)}, f)
        return

    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    shard_model(model, mesh)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():  # perturb every sharded parameter the same way on every rank
        for _, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.3
            full = param.data.full_tensor() + noise
            param.data.copy_(dist.tensor.distribute_tensor(full, mesh, param.data.placements))
    received = [0]
    handed = engine.load_weights(full_tensors(model, received))
    # every rank generates the same prompts here (at TP=2 the engine gathers both ranks' prompts)
    mine = PROMPTS if args.tp == 1 else PROMPTS[rank * 2 : rank * 2 + 2]
    out = greedy(engine, mine)
    if args.tp > 1:
        parts: list[list[list[int]]] = [[] for _ in range(world)]
        dist.all_gather_object(parts, out)
        out = [r for part in parts for r in part]
    state = {name: t.clone() for name, t in full_tensors(model)}
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        plain.load_state_dict(state, strict=False)
        plain.save_pretrained(os.path.join(args.out, "perturbed"))
        reference = []
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = plain.generate(
                    torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=0
                )[0, len(prompt) :].tolist()
                reference.append(ids[: ids.index(EOS) + 1] if EOS in ids else ids)
        with open(os.path.join(args.out, "sync.json"), "w") as f:
            json.dump({"greedy": out, "hf_greedy": reference, "handed": handed, "received": received[0]}, f)
    dist.barrier()  # the process group stays up: vLLM tears its groups down at exit


if __name__ == "__main__":
    main()
