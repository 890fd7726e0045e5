"""The delta suite (kvmove.bench.delta): its CPU twin, and the one-GPU run on a small slice."""

from __future__ import annotations

import pytest
import torch

from kvmove.bench.delta import DeltaBench, delta_bench


def _check(rows: list, bench: DeltaBench, classes: set[str]) -> None:
    assert [r.extra["step"] for r in rows] == list(range(1, bench.steps + 1))
    for r in rows:
        assert 0 < r.extra["changed_fraction_all"] < 0.1  # AdamW at 1e-6 on weights of std 0.02
        assert r.extra["delta_ratio"] <= 0.2 and r.bytes < r.extra["dense_bytes"]
        assert set(r.extra["changed_fraction"]) >= classes
        assert r.gbps > 0 and r.extra["fraction_of_device_copy"] > 0
        assert r.phases.keys() == {"pack", "detect_encode", "apply", "dense_land"}


def test_the_cpu_twin_steps_detects_and_lands_every_tensor_bit_exact() -> None:
    bench = DeltaBench.cpu_twin(layers=2, steps=5)  # qwen3-moe-tiny: a dense first layer, then MoE
    _check(delta_bench(bench, lambda _m: None), bench, {"attention", "dense_mlp", "experts", "embeddings"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_small_slice() -> None:
    bench = DeltaBench(layers=1, steps=5, copy_bytes=1 << 30)  # Qwen3-235B-A22B: every layer is MoE
    _check(delta_bench(bench, lambda _m: None), bench, {"attention", "experts", "embeddings"})
