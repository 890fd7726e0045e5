"""Decode step latency with and without migrations into the worker (``kvmove.bench.decode_latency``), tiny."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import torch

from kvmove.bench.decode_latency import DecodeLatencyConfig, decode_latency


def test_decode_latency_row_compares_free_and_migrating_windows() -> None:
    torch.set_num_threads(1)
    cfg = DecodeLatencyConfig(decoding=2, prompt_tokens=32, prompts=6, rounds=1, window_s=0.4, spawn_source=False)
    row = decode_latency(cfg, say=lambda _: None)
    e = row.extra
    assert row.kind == "measured" and row.suite == "decode-latency"
    assert e["steps_free"] > 0 and e["steps_migrating"] > 0, "the worker kept decoding in both windows"
    assert e["migrations"] >= 1 and row.bytes == e["migrations"] * 32 * 1024, "whole prompts moved each time"
    assert e["p50_ratio"] == pytest.approx(e["p50_migrating_s"] / e["p50_free_s"])
    assert e["p99_free_s"] >= e["p50_free_s"] and e["p99_migrating_s"] >= e["p50_migrating_s"]
