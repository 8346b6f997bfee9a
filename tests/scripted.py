"""Scripted episodes for the agent tests: a stand-in engine that answers each prompt with a fixed text chosen from the
conversation so far (tokenized and ended with the template's end-of-turn token), so that an episode's bookkeeping can
be checked token by token, and the helpers that run episodes with it."""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from lightning_rlhf.agents.env import environment_factory
from lightning_rlhf.agents.rollout import EpisodeRunner, sample_episodes
from lightning_rlhf.agents.tokens import check_chat_template
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.demo.tiny import build_tiny_tokenizer
from lightning_rlhf.engines.rollout.base import EngineAbilities, RolloutOutput, SamplingParams
from lightning_rlhf.engines.rollout.requests import BatchedRequestQueue

# A chat template in Qwen2.5's layout (written here from its documented rendering): turns between <|im_start|>ROLE
# and <|im_end|>, tools listed in the system turn, consecutive tool results in one user turn as <tool_response>s.
QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "\n\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_style_tokenizer():
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN_STYLE
    tok.eos_token = "<|im_end|>"
    return tok


TOKENIZERS = {"demo": build_tiny_tokenizer, "qwen-style": qwen_style_tokenizer}


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 41"}}\n</tool_call>'


class ScriptedEngine:
    """Answers from the conversation so far: a tool call, then (once a tool result is in it) the answer."""

    def __init__(self, tokenizer, script=None) -> None:
        self.tok = tokenizer
        self.eot = check_chat_template(tokenizer).end_of_turn_id
        self.calls: list[int] = []
        self.prompts_read: list[int] = []
        self.script = script or (
            lambda text: (
                f"The answer is {text.split('1517')[0] and 1517}." if "1517" in text else f"Let me compute.\n{CALL}"
            )
        )

    tp_size = 1  # a whole engine per rank
    abilities = EngineAbilities()
    context_length: int | None = None

    @functools.cached_property
    def requests(self) -> BatchedRequestQueue:  # rounds of generate calls
        return BatchedRequestQueue(self)

    def agree(self, calls: int, busy: bool) -> tuple[int, bool]:
        return calls, busy

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        self.calls.append(len(prompts) * params.n)  # episodes served
        self.prompts_read.append(len(prompts))
        out = []
        for ids in prompts:
            text = self.script(self.tok.decode(ids))
            reply = [*self.tok.encode(text, add_special_tokens=False), self.eot][: params.max_new_tokens]
            out += [reply] * params.n  # n samples per prompt, consecutively (the engines' order)
        return RolloutOutput(out, [[-0.5] * len(r) for r in out])


def prompt_batch(tok, texts: list[str]) -> Batch:
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, ids))
    prompts = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        prompts[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return Batch({"prompts": prompts, "prompt_mask": mask, "uid": torch.arange(len(ids))}, {"prompt": texts})


def run(
    tok, env, cfg: RolloutConfig, texts=("37*41=?",), n=1, engine=None, batch: Batch | None = None
) -> tuple[Batch, ScriptedEngine]:
    """Episodes of ``env`` for ``texts`` (or for ``batch``, a data module's, with its meta)."""
    engine = engine or ScriptedEngine(tok)
    runner = EpisodeRunner(environment_factory(env), tok, cfg)
    try:
        stops = (check_chat_template(tok).end_of_turn_id,)
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens, stop_token_ids=stops, seed=3)
        return sample_episodes(
            engine, batch or prompt_batch(tok, list(texts)), runner, params, n=n, pad_id=tok.pad_token_id
        ), engine
    finally:
        runner.close()


def tiny_engine(device: str = "cpu", *, decode: str = "loop") -> Any:
    """A transformers engine on the demo's tiny model: its decoding loop on CPU, transformers' ``generate`` (fp32) on a
    GPU."""
    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.demo.tiny import build_tiny_model
    from lightning_rlhf.engines.rollout.hf import HFRolloutEngine

    tok = build_tiny_tokenizer()
    return HFRolloutEngine(
        build_tiny_model(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        device=torch.device(device),
        dtype=torch.float32,
        decode=decode,
        decode_loop=CPULayer().decode_loop() if decode == "loop" else None,
    )


def interrupt_at(engine: Any, check: int) -> threading.Event:
    """Make ``engine``'s next request step wait, at its ``check``-th interrupt check (the chunk's, then one per
    decoding step), until its queue is interrupted (a pause), so that a test pauses a stream at a known token; the
    event is set when the step waits there."""
    reached, sample, queue = threading.Event(), engine.sample, engine.requests

    def waiting(*args: Any, stop: Any = None, **kwargs: Any) -> Any:
        checks = [0]

        def wrapped() -> bool:
            checks[0] += 1
            if checks[0] == check and not reached.is_set():
                reached.set()
                assert queue._stop.wait(timeout=60), "the pause never interrupted the step"
            return bool(stop())

        return sample(*args, stop=wrapped, **kwargs)

    engine.sample = waiting
    return reached
