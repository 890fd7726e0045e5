"""Pull programs: covers quantize straight into a slot in one call per evenly spaced run (experts interleaved in
the arena, covers in turn in the slot), parts copy in one strided copy per run, bit-identical to one at a time."""

from __future__ import annotations

import pytest
import torch

from kvmove.quant import NonFiniteWeightError, quantize, scale_shape
from kvmove.quant.batch import stacked_runs
from kvmove.sync.programs import ProgramBuilder, as_words

E, R, C = 4, 256, 320  # 4 experts; (R, C) gate/up, (C, R) down; the last column block partial


def _arena() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """A layer's experts as a fused MoE arena lays them out: gate, up of each expert in turn, then every down."""
    arena = torch.randn(3 * E * R * C, dtype=torch.bfloat16)
    n = R * C
    gates = [arena[(2 * e) * n : (2 * e + 1) * n].view(R, C) for e in range(E)]
    ups = [arena[(2 * e + 1) * n : (2 * e + 2) * n].view(R, C) for e in range(E)]
    downs = [arena[(2 * E + e) * n : (2 * E + e + 1) * n].view(C, R) for e in range(E)]
    return gates, ups, downs


def _slot_parts(slot: torch.Tensor, covers: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each cover's weight then scales, back to back in the slot (16-byte aligned), as a pull packs them."""
    out, at = [], 0
    for x in covers:
        sshape = scale_shape(x.shape)
        w = slot[at : at + x.numel()].view(torch.float8_e4m3fn).view(x.shape)
        at += -(-x.numel() // 16) * 16
        s = slot[at : at + 4 * sshape[0] * sshape[1]].view(torch.float32).view(sshape)
        at += -(-4 * sshape[0] * sshape[1] // 16) * 16
        out.append((w, s))
    return out


def _same(w: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> bool:
    q = quantize(x)
    return torch.equal(w.view(torch.uint8), q.weight.view(torch.uint8)) and torch.equal(s, q.scale_inv)


def test_experts_quantize_into_the_slot_one_call_per_projection() -> None:
    gates, ups, downs = _arena()
    covers = [x for e in range(E) for x in (gates[e], ups[e], downs[e])]  # the pull's order: expert by expert
    slot = torch.zeros(4 * E * R * C, dtype=torch.uint8)
    parts = _slot_parts(slot, covers)
    b = ProgramBuilder()
    for x, (w, s) in zip(covers, parts, strict=True):
        b.quantize(x, "w", w, s)
    program = b.build(persistent=True)
    assert len(program.quantize) == 3 and not program.copies and program.scratch_bytes == 0
    program.run()
    assert all(_same(w, s, x) for x, (w, s) in zip(covers, parts, strict=True))


def test_parts_copy_into_a_fused_parameter_in_one_copy() -> None:
    gates, ups, _ = _arena()
    w13 = torch.zeros(E, 2 * R, C, dtype=torch.bfloat16)
    b = ProgramBuilder()
    for e in range(E):
        b.copy(w13[e, :R], gates[e])
        b.copy(w13[e, R:], ups[e])
    program = b.build(persistent=True)
    assert len(program.copies) == 1  # gate, up, gate, ... evenly spaced on both sides
    assert program.copies[0].dst.dtype == torch.int64  # 640-byte rows move as 8-byte words
    program.run()
    assert torch.equal(w13, torch.stack([torch.cat([gates[e], ups[e]]) for e in range(E)]))


def test_parts_of_a_cover_go_through_scratch() -> None:
    """A region reading half of a cover (an engine that splits a tensor finer than its blocks cut)."""
    x = torch.randn(2 * R, C, dtype=torch.bfloat16)
    dst = torch.zeros(R, C, dtype=torch.float8_e4m3fn)
    b = ProgramBuilder()
    b.quantize(x, "w", then=lambda w, s: b.copy(dst, w[R:]))
    program = b.build(persistent=False)
    assert program.scratch_bytes > 0 and len(program.copies) == 1
    program.run()
    assert torch.equal(dst.view(torch.uint8), quantize(x).weight[R:].view(torch.uint8))


def test_uneven_overlapping_and_capped_runs_stay_apart() -> None:
    base = torch.randn(1024, 256)
    uneven = [(base[0:128],), (base[128:256],), (base[384:512],)]
    assert sorted(len(run) for run, _ in stacked_runs(uneven)) == [1, 2]
    overlapping = [(base[0:256],), (base[128:384],)]
    assert [len(run) for run, _ in stacked_runs(overlapping)] == [1, 1]
    rows = [(base[i * 128 : (i + 1) * 128],) for i in range(8)]
    assert [len(run) for run, _ in stacked_runs(rows, limit=3 * 128 * 256)] == [3, 3, 2]


def test_a_non_finite_block_fails_the_program_naming_it() -> None:
    gates, _, _ = _arena()
    gates[2][5, 7] = float("nan")
    b = ProgramBuilder()
    for e, x in enumerate(gates):
        b.quantize(x, f"layers.0.experts.{e}.gate_proj.weight")
    program = b.build(persistent=False)
    with pytest.raises(NonFiniteWeightError, match=r"experts\.0\.gate_proj\.weight \(and 3 more\): 1 of"):
        program.run()
    program.run(check=False)  # a warm-up run does not read the scales back


def test_a_warm_up_runs_every_step_without_reading_the_scales_back() -> None:
    gates, _, _ = _arena()
    gates[1][0, 0] = float("inf")  # an init-time arena may hold any bits
    slot = torch.zeros(1 << 20, dtype=torch.uint8)
    b = ProgramBuilder()
    for x, (w, s) in zip(gates, _slot_parts(slot, gates), strict=True):
        b.quantize(x, "w", w, s)
    program = b.build(persistent=True)
    slot.copy_(torch.randint(0, 256, slot.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    before = slot.clone()
    program.warm(restore=True)  # an engine's mapped pull: it puts back what it wrote (any bits, NaN payloads too)
    assert torch.equal(slot, before)
    program.warm()  # no NonFiniteWeightError: nothing is read back
    assert not torch.equal(slot, before)


def test_a_restoring_warm_up_leaves_the_destinations_bit_for_bit() -> None:
    """An engine's landing program warmed at init: the slot first takes the parameter's bytes, then lands them back,
    so a live parameter (any bits, NaN payloads included) is unchanged and every copy ran."""
    fused = torch.randint(0, 256, (E, 2 * R, C), dtype=torch.uint8).view(torch.float8_e4m3fn)
    before = fused.view(torch.uint8).clone()
    slot = torch.zeros(2 * E * R * C, dtype=torch.uint8)
    b = ProgramBuilder()
    for e in range(E):
        for half in range(2):
            at = (2 * e + half) * R * C
            b.copy(fused[e, half * R : (half + 1) * R], slot[at : at + R * C].view(torch.float8_e4m3fn).view(R, C))
    program = b.build(persistent=True)
    assert len(program.copies) < 2 * E
    program.warm(restore=True)
    assert torch.equal(fused.view(torch.uint8), before)
    assert torch.equal(slot.view(E, 2 * R, C), before)  # each part took its destination's bytes


def test_byte_copies_move_as_the_widest_words_both_sides_allow() -> None:
    slot = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    fused = torch.zeros(8, 64, dtype=torch.uint8).view(torch.float8_e4m3fn)
    cases = [  # (dst, src, word): rows of 48 bytes at offset 16 -> 16-byte multiples; 12 -> 4; 6 at offset 2 -> 2
        (fused[:, 16:], slot[:384].view(torch.float8_e4m3fn).view(8, 48), torch.int64),
        (fused[:, 4:16], slot[400:496].view(torch.float8_e4m3fn).view(8, 12), torch.int32),
        (fused[:, 2:8], slot[512:560].view(torch.float8_e4m3fn).view(8, 6), torch.int16),
        (fused[:, 1:2], slot[600:608].view(torch.float8_e4m3fn).view(8, 1), torch.float8_e4m3fn),
    ]
    for dst, src, word in cases:
        d, s = as_words(dst, src)
        assert d.dtype == s.dtype == word
        d.copy_(s)
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    mixed = torch.zeros(8, 12, dtype=torch.float32), torch.zeros(8, 12, dtype=torch.bfloat16)
    assert as_words(*mixed)[0].dtype == torch.float32  # not a byte copy: left alone
