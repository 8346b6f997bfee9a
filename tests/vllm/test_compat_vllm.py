"""Each vLLM access in ``lightning_rlhf/compat/vllm.py`` checked against the installed vLLM (without building an
engine: the names, their signatures and what they return): a release that renames or reshapes one fails here,
naming the function; the engine tests in this folder run them on real engines."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm")

from lightning_rlhf.compat.vllm import LOADER_LOGGERS, cpu_attention_head_sizes  # noqa: E402


def parameters(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_the_engine_methods_the_step_by_step_requests_use_are_there() -> None:
    from vllm.entrypoints.llm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    assert "self.llm_engine = " in inspect.getsource(LLM.__init__)
    assert parameters(LLMEngine.add_request)[:4] == ["self", "request_id", "prompt", "params"]
    assert "lora_request" in parameters(LLMEngine.add_request)
    assert parameters(LLMEngine.step) == ["self"]
    assert parameters(LLMEngine.abort_request) == ["self", "request_ids", "internal"]
    assert parameters(LLMEngine.remove_lora) == ["self", "lora_id"]
    assert "get_vocab_size" in dir(vllm.config.ModelConfig)
    # sampled_so_far reads a running request's state (the engine test cuts requests with it)
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

    assert "self.output_processor = OutputProcessor(" in inspect.getsource(LLMEngine.__init__)
    assert "self.request_states" in inspect.getsource(OutputProcessor.__init__)
    assert "self.detokenizer = " in inspect.getsource(RequestState.__init__)
    assert "self.logprobs_processor = " in inspect.getsource(RequestState.__init__)
    assert isinstance(inspect.getattr_static(IncrementalDetokenizer, "output_token_ids"), property)
    assert "logprobs" in {f.name for f in __import__("dataclasses").fields(LogprobsProcessor)}


def test_the_workers_reload_weights_takes_a_weights_iterator() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert CPUWorker.reload_weights is Worker.reload_weights
    assert "weights_iterator" in parameters(GPUModelRunner.reload_weights)


def test_the_layerwise_reload_takes_the_model_and_its_config() -> None:
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_processing,
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    assert parameters(initialize_layerwise_reload) == ["model"]
    assert parameters(finalize_layerwise_processing) == ["model", "model_config"]
    assert "finalize_layerwise_processing(*args, **kwargs)" in inspect.getsource(finalize_layerwise_reload)


def test_a_layer_taken_out_of_the_reload_gets_its_own_tensors_back_and_is_not_processed() -> None:
    from vllm.model_executor.model_loader.reload import layerwise

    from lightning_rlhf.compat.vllm import load_in_place

    layer = torch.nn.Linear(4, 3, bias=False)
    kernel = layer.weight
    layerwise.record_metadata_for_reloading(layer)
    layerwise.initialize_layerwise_reload(layer)
    assert layer.weight.is_meta and layerwise.get_layerwise_info(layer).can_load()
    load_in_place(layer)
    assert layer.weight is kernel and not layerwise.get_layerwise_info(layer).can_load()
    layer.weight.data.copy_(torch.ones(3, 4))  # what the layer's own loader does
    layerwise.finalize_layerwise_processing(layer, None)  # skipped: neither processed nor put back
    assert layer.weight is kernel and torch.equal(layer.weight, torch.ones(3, 4))


def test_the_row_sums_read_the_layers_attributes_they_name() -> None:
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
        VocabParallelEmbeddingShardIndices,
    )
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    source = inspect.getsource(linear)
    assert "self.input_size_per_partition =" in source and "self.output_partition_sizes =" in source
    assert parameters(linear.UnquantizedLinearMethod.apply)[:3] == ["self", "layer", "x"]
    assert issubclass(ParallelLMHead, VocabParallelEmbedding)
    assert "self.shard_indices" in inspect.getsource(VocabParallelEmbedding.__init__)
    assert hasattr(VocabParallelEmbeddingShardIndices, "num_org_elements")
    assert all("self.model_runner" in inspect.getsource(w) for w in (Worker, CPUWorker))


def test_cpu_attention_head_sizes_are_whole_numbers_with_the_common_ones() -> None:
    sizes = cpu_attention_head_sizes()
    assert all(isinstance(s, int) for s in sizes) and {64, 128} <= set(sizes)


def test_the_filtered_loggers_are_vllm_modules() -> None:
    assert all(importlib.util.find_spec(name) is not None for name in LOADER_LOGGERS)


def test_model_parallel_initialized_is_false_until_an_engine_sets_up_its_groups() -> None:
    code = (
        "from lightning_rlhf.compat.vllm import model_parallel_initialized as m; a = m(); "
        "import vllm.distributed.parallel_state; print(a, m())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["False", "False"]


def test_the_smallest_temperature_is_the_one_vllm_raises_smaller_ones_to() -> None:
    from vllm.sampling_params import _MAX_TEMP

    from lightning_rlhf.config.settings import MIN_TEMPERATURE

    assert MIN_TEMPERATURE == _MAX_TEMP
