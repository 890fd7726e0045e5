"""The gpu-fp8 suite's CPU twin: the same code on CPU devices (processes launcher, no Ray), a BF16 and an FP8
engine synced v3 in one run, every sync verified, FP8 rows holding their ratios to the BF16 ones."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmove.bench.gpu import GpuSuite
from kvmove.bench.gpu_fp8 import gpu_fp8_suite
from kvmove.bench.results import Row
from kvmove.errors import KvmoveError


def test_cpu_twin_syncs_bf16_and_fp8_engines_side_by_side() -> None:
    suite = replace(GpuSuite.cpu_twin(), model="qwen3-moe-fp8-tiny", syncs=1, transports=("gloo",))
    recorded: list[list[Row]] = []
    rows = gpu_fp8_suite(suite, recorded.append, lambda _: None)
    assert [r for batch in recorded for r in batch] == rows
    syncs = [r for r in rows if r.name.startswith("fp8 sync")]
    assert [r.name for r in syncs] == ["fp8 sync v3 bf16", "fp8 sync v3 fp8"]
    bf16, fp8 = syncs
    for r in syncs:
        planned = r.extra["planned_bytes"]  # plus the parts' 16-byte alignment in packed pulls
        assert r.extra["verified"] is True and planned <= r.bytes < 1.01 * planned, r  # type: ignore[operator]
        assert r.link_limit_gbps == next(c.gbps for c in rows if c.name.startswith("ceiling p2p"))
    assert (bf16.extra["engine_dtype"], fp8.extra["engine_dtype"]) == ("bf16", "fp8")
    assert set(fp8.extra["bytes_by_transform"]) == {"plain", "trainer"}  # one trainer rank holds whole blocks
    assert fp8.extra["bytes_vs_bf16"] == pytest.approx(fp8.bytes / bf16.bytes) and fp8.bytes < 0.6 * bf16.bytes
    assert fp8.extra["time_vs_bf16"] == pytest.approx(fp8.seconds / bf16.seconds)


def test_no_usable_transport_is_a_clear_error() -> None:
    suite = replace(GpuSuite.cpu_twin(), transports=("no-such-transport",))
    with pytest.raises(KvmoveError, match="no pull transport of no-such-transport runs here"):
        from kvmove.bench.gpu_fp8 import fp8_syncs

        fp8_syncs(suite, 0.0, lambda _: None, lambda _: None)
