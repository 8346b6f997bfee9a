"""FSDP2's all-gathers and reduce-scatters through the host's shared memory (2 processes under torchrun)."""

from __future__ import annotations

from tests.unit.test_reshard import ok_lines_of_two_ranks


def test_shared_memory_collectives_give_gloos_results_bitwise() -> None:
    # tests/scripts/host_collectives_check.py asserts each collective and two training steps against gloo's
    lines = ok_lines_of_two_ranks("host_collectives_check.py")
    assert [line[1] for line in lines] == ["0", "1"]
    for line in lines:
        assert line[2:] == ["19", "2"]  # 19 calls through shared memory; the 2 over the size limit through gloo
