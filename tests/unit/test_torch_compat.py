"""Each private PyTorch access of the package (``lightning_rlhf/compat/torch.py``, and oneDNN's private operators in
``lightning_rlhf/cpu/onednn.py``) checked against the installed torch: a release that renames or changes one fails
here, with the name of the access, before any training run meets it."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_rlhf.compat.torch import (
    fsdp_params,
    local_shape_and_offset,
    local_tensor,
    put_buffer,
    put_parameter,
    set_local_tensor,
    sharded_param_data,
)
from lightning_rlhf.cpu import onednn


def _fsdp_checks(rank: int, init: str, out: str) -> None:
    """One gloo process (world size 1) with an FSDP2-sharded linear layer; writes each check's outcome (values, or
    the error's traceback) so that each test below fails on its own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1)
    results: dict[str, Any] = {}

    def check(name: str, fn: Any) -> None:
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}

    try:
        model = nn.Linear(4, 6)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        weight = model.weight

        def read_local() -> dict[str, Any]:
            local = local_tensor(weight)
            return {
                "has_attribute": isinstance(getattr(weight, "_local_tensor", None), torch.Tensor),
                "same_storage": local.data_ptr() == weight.to_local().data_ptr(),
                "plain": type(local) is torch.Tensor,
                "plain_tensor_is_itself": local_tensor(local) is local,
            }

        def write_local() -> dict[str, Any]:
            units = {id(u.sharded_param): u for u in fsdp_params(model)}
            unit = units[id(weight)]
            before = local_tensor(weight)
            place = torch.empty(before.numel() * 2)[: before.numel()].view_as(before).copy_(before)
            set_local_tensor(weight, place)
            unit.reset_sharded_param()
            moved = local_tensor(weight).data_ptr() == place.data_ptr()
            followed = sharded_param_data(unit).data_ptr() == place.data_ptr()
            set_local_tensor(weight, before)
            unit.reset_sharded_param()
            return {
                "moved": moved,
                "fsdp_followed": followed,
                "back": local_tensor(weight).data_ptr() == before.data_ptr(),
            }

        def list_params() -> dict[str, Any]:
            units = fsdp_params(model)
            return {
                "count": len(units),
                "params": {id(u.sharded_param) for u in units} == {id(model.weight), id(model.bias)},
                "flat_is_shard": all(
                    sharded_param_data(u).data_ptr() == local_tensor(u.sharded_param).data_ptr() for u in units
                ),
                "padded_size": [tuple(getattr(u, "padded_sharded_param_size", ())) for u in units],
            }

        check("local_tensor", read_local)
        check("set_local_tensor", write_local)
        check("fsdp_params", list_params)
        check("local_shape_and_offset", lambda: local_shape_and_offset(weight))
    finally:
        torch.save(results, f"{out}/results.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch.multiprocessing as mp

    folder: Path = tmp_path_factory.mktemp("torch_compat")
    mp.start_processes(_fsdp_checks, args=(f"file://{folder}/store", str(folder)), nprocs=1, start_method="spawn")
    results: dict[str, Any] = torch.load(folder / "results.pt", weights_only=False)
    return results


def _outcome(results: dict[str, Any], name: str) -> Any:
    value = results[name]
    assert not (isinstance(value, dict) and "error" in value), f"torch_compat.{name} broke:\n{value['error']}"
    return value


def test_local_tensor_reads_the_dtensors_own_shard(fsdp_results: dict[str, Any]) -> None:
    assert _outcome(fsdp_results, "local_tensor") == {
        "has_attribute": True,
        "same_storage": True,
        "plain": True,
        "plain_tensor_is_itself": True,
    }


def test_set_local_tensor_moves_the_shard_and_fsdp_follows(fsdp_results: dict[str, Any]) -> None:
    assert _outcome(fsdp_results, "set_local_tensor") == {"moved": True, "fsdp_followed": True, "back": True}


def test_fsdp_params_and_their_flat_shards(fsdp_results: dict[str, Any]) -> None:
    found = _outcome(fsdp_results, "fsdp_params")
    assert found == {"count": 2, "params": True, "flat_is_shard": True, "padded_size": [(6, 4), (6,)]}


def test_local_shape_and_offset(fsdp_results: dict[str, Any]) -> None:
    assert _outcome(fsdp_results, "local_shape_and_offset") == ((6, 4), (0, 0))


def test_put_parameter_replaces_without_registering() -> None:
    from torch.nn.modules.module import register_module_parameter_registration_hook

    layer = nn.Linear(2, 3)
    new = nn.Parameter(torch.ones(3, 2))
    seen: list[str] = []
    handle = register_module_parameter_registration_hook(lambda module, name, param: seen.append(name))
    try:
        put_parameter(layer, "weight", new)
    finally:
        handle.remove()
    assert layer.weight is new and dict(layer.named_parameters())["weight"] is new
    assert torch.equal(layer(torch.zeros(1, 2)), layer.bias.detach().unsqueeze(0))
    assert seen == []  # the loaders' patched register_parameter must not see the replacement


def test_put_buffer_keeps_persistence() -> None:
    norm = nn.BatchNorm1d(2)
    norm.register_buffer("scratch", torch.zeros(1), persistent=False)
    put_buffer(norm, "scratch", torch.ones(1))
    put_buffer(norm, "running_mean", torch.full((2,), 3.0))
    assert torch.equal(norm.scratch, torch.ones(1)) and "scratch" not in norm.state_dict()
    assert torch.equal(norm.state_dict()["running_mean"], torch.full((2,), 3.0))


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


@needs_onednn
def test_onednn_linear_pointwise_and_packed_weights() -> None:
    torch.manual_seed(0)
    x, weight, bias = torch.randn(5, 8), torch.randn(16, 8), torch.randn(16)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(onednn.linear_pointwise(x, weight, bias), expected)
    torch.testing.assert_close(onednn.linear_pointwise(x, onednn.reorder_linear_weight(weight, 5), bias), expected)


@needs_onednn
def test_onednn_bf16_probe() -> None:
    assert hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")
    assert isinstance(onednn.bf16_supported(), bool)


def test_unsafe_view_relabels_without_a_copy() -> None:
    base = torch.arange(6.0)
    view = base.view(2, 3)
    out = onednn.unsafe_view(view)
    assert out._base is None and out.data_ptr() == base.data_ptr() and torch.equal(out, view)
