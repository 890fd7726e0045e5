"""Bounded staging of a vLLM worker's updates, as pure planning (no vLLM needed): units, the window and its
slots, the slots a landing order needs, the budget, and the validation an update passes before anything changes;
and the tensor-memory measure the vLLM memory tests read inside the worker."""

from __future__ import annotations

import pytest
import torch

from kvmove.errors import KvmoveError
from kvmove.sync.planning.plan import Box, ParamMeta, Region
from kvmove.sync.planning.recording import StridedView
from kvmove.vllm.memory import tensor_memory
from kvmove.vllm.staging import (
    ALIGN,
    Budget,
    check_received,
    describe,
    slots_needed,
    staging_units,
    unit_key,
    window_layout,
)

BF16 = torch.bfloat16
PARAMS = [
    ParamMeta("model.embed_tokens.weight", (320, 128), BF16),
    ParamMeta("model.layers.0.input_layernorm.weight", (128,), BF16),
    ParamMeta("model.layers.0.self_attn.qkv_proj.weight", (384, 128), BF16),
    ParamMeta("model.layers.0.self_attn.qkv_proj.bias", (384,), BF16),
    ParamMeta("model.layers.0.mlp.down_proj.weight", (100, 99), BF16),
    ParamMeta("model.layers.1.input_layernorm.weight", (128,), BF16),
    ParamMeta("model.layers.1.self_attn.qkv_proj.weight", (384, 128), BF16),
    ParamMeta("model.layers.1.self_attn.qkv_proj.bias", (384,), BF16),
    ParamMeta("model.layers.1.mlp.down_proj.weight", (100, 99), BF16),
    ParamMeta("model.norm.weight", (128,), BF16),
]
STAGED = {p.name for p in PARAMS if "norm" not in p.name}  # norms: processing is the identity, they land live


def test_units_are_decoder_layers_and_modules_outside_them() -> None:
    assert unit_key("model.layers.12.self_attn.qkv_proj.weight") == "model.layers.12"
    assert unit_key("model.embed_tokens.weight") == "model.embed_tokens"
    assert unit_key("lm_head.weight") == "lm_head"
    units = staging_units(PARAMS, STAGED)
    assert list(units) == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    layer = units["model.layers.0"]
    assert layer.params == (
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.qkv_proj.bias",
        "model.layers.0.mlp.down_proj.weight",
    )
    assert layer.nbytes == 384 * 128 * 2 + 768 + 19968  # down_proj (19800 bytes) aligned to 19968
    assert all(n % ALIGN == 0 for n in (u.nbytes for u in units.values()))


def test_the_window_is_slots_of_the_largest_unit_whatever_the_model_size() -> None:
    units = staging_units(PARAMS, STAGED)
    one = window_layout(units, PARAMS)
    assert one.slots == 1 and one.slot_bytes == max(u.nbytes for u in units.values())
    assert one.nbytes == units["model.layers.0"].nbytes  # a decoder layer, not the model
    assert one.offsets["model.layers.1.self_attn.qkv_proj.weight"] == 0  # every unit starts its slot
    assert one.offsets["model.layers.1.self_attn.qkv_proj.bias"] == 384 * 128 * 2
    assert one.unit_of("model.layers.1.mlp.down_proj.weight") == "model.layers.1"
    assert one.unit_of("model.norm.weight") is None  # lands in the live model
    two = window_layout(units, PARAMS, slots=2)
    assert two.nbytes == 2 * one.nbytes
    assert [two.slot_of[k] for k in units] == [0, 1, 0]
    empty = window_layout({}, PARAMS)
    assert empty.nbytes == 0


def test_slots_needed_follows_the_landing_order() -> None:
    units = ["e", "l0", "l1", "l2", "h"]
    expected = {"e": 1, "l0": 3, "l1": 3, "l2": 3, "h": 1}
    by_blocks = ["e", "l0", "l0", "l0", "l1", "l1", "l1", "l2", "l2", "l2", "h"]
    assert slots_needed(by_blocks, expected, units) == 1
    # two pipeline stages interleaved (layers 0 and 2 open at once): slots are fixed (ordinal modulo slots), and
    # with two both layers would take slot 1, so three
    interleaved = ["e", "l0", "l2", "l0", "l2", "l0", "l2", "l1", "l1", "l1", "h"]
    assert slots_needed(interleaved, expected, units) == 3
    assert slots_needed(["e", "l0", "l1", "l0", "l1", "l0", "l1", "l2", "l2", "l2", "h"], expected, units) == 2
    # one pull per trainer rank spanning every layer (v2 with two ranks): every layer is open at once
    whole = ["e", "l0", "l1", "l2", "l0", "l1", "l2", "l0", "l1", "l2", "h"]
    assert slots_needed(whole, expected, units) == 3  # one per layer


def test_a_window_over_the_budget_is_refused_naming_what_to_do() -> None:
    units = staging_units(PARAMS, STAGED)
    layout = window_layout(units, PARAMS, slots=3)
    Budget().check(layout, "v2")  # no budget set: any window
    Budget(layout.nbytes).check(layout, "v2")
    with pytest.raises(KvmoveError, match=r"3 slot\(s\) .* over the staging budget .* \(v3\)"):
        Budget(layout.nbytes - 1).check(layout, "the landing order of v2")


def _region(hf: str, param: str, rows: tuple[int, int], shape: tuple[int, int]) -> Region:
    n = (rows[1] - rows[0]) * shape[1]
    dst = StridedView(rows[0] * shape[1], (rows[1] - rows[0], shape[1]), (shape[1], 1))
    box = Box((0, 0), (rows[1] - rows[0], shape[1]))
    return Region(hf, (), None, box, param, dst, BF16, n * 2)


QKV = "model.layers.0.self_attn.qkv_proj.weight"
REGIONS = [
    _region("model.layers.0.self_attn.q_proj.weight", QKV, (0, 128), (384, 128)),
    _region("model.layers.0.self_attn.k_proj.weight", QKV, (128, 256), (384, 128)),
    _region("model.layers.0.self_attn.v_proj.weight", QKV, (256, 384), (384, 128)),
    _region("model.layers.0.input_layernorm.weight", "model.layers.0.input_layernorm.weight", (0, 1), (1, 128)),
]
SHAPES = {r.hf_name: r.box.shape for r in REGIONS}


def _got(*names: str, shape: tuple[int, ...] = (128, 128), dtype: torch.dtype = BF16) -> dict:
    return {n: (shape if "norm" not in n else (1, 128), dtype) for n in names}


def test_a_whole_update_and_a_fillable_part_pass() -> None:
    names = [r.hf_name for r in REGIONS]
    assert check_received(REGIONS, _got(*names), SHAPES, STAGED, lambda p: False) == []
    q = "model.layers.0.self_attn.q_proj.weight"  # a third of the fused qkv_proj: the rest comes from the live model
    assert check_received(REGIONS, _got(q), SHAPES, STAGED, lambda p: True) == []


def test_every_bad_update_is_named_before_anything_changes() -> None:
    q = "model.layers.0.self_attn.q_proj.weight"
    unknown = check_received(REGIONS, _got("model.layers.0.mlp.nope.weight"), SHAPES, STAGED, lambda p: True)
    assert [p.why for p in unknown] == ["no parameter of this engine reads it"]
    shape = check_received(REGIONS, _got(q, shape=(128, 64)), SHAPES, STAGED, lambda p: True)
    assert shape[0].why == "shape (128, 64), the checkpoint's is (128, 128)"
    dtype = check_received(REGIONS, _got(q, dtype=torch.float32), SHAPES, STAGED, lambda p: True)
    assert dtype[0].why == "dtype torch.float32, the engine loads torch.bfloat16"
    part = check_received(REGIONS, _got(q), SHAPES, STAGED, lambda p: False)
    assert part[0].tensor == "model.layers.0.self_attn.k_proj.weight" and QKV in part[0].why
    assert "k_proj" in describe(part)
    many = describe([part[0]] * 6)
    assert many.endswith("(6 problems)")


def test_tensor_memory_counts_each_storage_once() -> None:
    before = tensor_memory("cpu")
    big = torch.empty(1 << 20, dtype=torch.uint8)
    views = [big[:10], big.view(torch.int32), big[100:]]  # they share the one storage
    after = tensor_memory("cpu")
    assert after.bytes_by_device["cpu"] - before.bytes_by_device.get("cpu", 0) == 1 << 20
    del big, views
    assert tensor_memory("cpu").bytes_by_device.get("cpu", 0) == before.bytes_by_device.get("cpu", 0)
    assert tensor_memory("meta").total == 0
