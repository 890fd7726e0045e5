"""The delta's Triton kernels on CPU, run by Triton's interpreter. The comparison (kvmove.sync.delta.triton_diff):
for pulls whose copies are stacks of rows (interleaved in the slot, rows longer than a program's chunk, int64 and
byte words), the same changed words, positions, values and image as the torch
comparison, and the same refusal one word past the limit. The engine's scatter (kvmove.sync.delta.triton_apply):
the same parameters as the torch scatter, over many storages and parts sharing one.

Runs where triton is installed and no GPU is (``make test-vllm``'s environment has it); on a GPU machine
tests/sync/delta/test_triton_diff_gpu.py runs the compiled kernels instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("a GPU runs the compiled kernels (test_triton_diff_gpu.py)", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (its CPU interpreter runs this test)")

from kvmove.sync.delta import triton_diff
from kvmove.sync.delta.apply import Scatter
from kvmove.sync.delta.diff import Steps, _rows, diff, program_steps, slot_steps
from kvmove.sync.delta.encoding import Words, most_changed, payload_words
from kvmove.sync.planning.packing import pack_layout
from kvmove.sync.programs import ProgramBuilder


class Pull:
    """Sources packed back to back into a slot by one program (the builder batches what it can)."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.sizes = [t.numel() * t.element_size() for t in parts]
        self.words: Words = payload_words(self.sizes)
        self.slot = torch.zeros(pack_layout(self.sizes).nbytes, dtype=torch.uint8)
        b = ProgramBuilder()
        for t, off, n in zip(parts, pack_layout(self.sizes).offsets, self.sizes, strict=True):
            b.copy(self.slot[off : off + n].view(t.dtype).view(t.shape), t)
        self.program = b.build(persistent=True)

    def payload(self) -> torch.Tensor:
        self.program.run()
        return self.slot.clone()

    def change(self, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in self.parts:
            flat = t.view(torch.uint8) if self.words.dtype == torch.uint8 else t.view(torch.int16)
            for _ in range(count):
                index = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in flat.shape)
                flat[index] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def interleaved() -> list[torch.Tensor]:
    """4 experts' gate and down in turn, from two stacked sources (one strided): two 3-D steps that interleave."""
    gate, down = _randn(4, 2, 16, seed=1)[:, :, 4:12], _randn(4, 3, 8, seed=2)
    return [t for e in range(4) for t in (gate[e], down[e])] + [_randn(3, seed=3)]


def long_rows() -> list[torch.Tensor]:
    """A column slice whose rows span three chunks of a program, and a long contiguous vector."""
    cols = 2 * triton_diff.CHUNK + 77
    return [_randn(3, cols + 100, seed=4)[:, 50 : 50 + cols], _randn(3 * triton_diff.CHUNK + 5, seed=5)]


def bytes_words() -> list[torch.Tensor]:
    """An odd-sized part: the payload is compared in bytes."""
    return [torch.randint(0, 255, (5, 33), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))]


PULLS: dict[str, Callable[[], list[torch.Tensor]]] = {
    "interleaved": interleaved,
    "long-rows": long_rows,
    "bytes": bytes_words,
}


def _steps(pull: Pull, packed: bool) -> Steps:
    if packed:
        pull.program.run()
        return slot_steps(pull.slot, pull.words)
    steps = program_steps(pull.program, pull.slot, pull.words)
    assert steps is not None
    return steps


def _both(pull: Pull, image: torch.Tensor, packed: bool, limit: int) -> tuple:
    mine, theirs = image.clone(), image.clone()
    got = diff(_steps(pull, packed), mine, pull.words, limit, backend="triton")
    want = diff(_steps(pull, packed), theirs, pull.words, limit, backend="torch")
    return got, want, mine, theirs


@pytest.mark.parametrize("name", list(PULLS))
def test_the_triton_comparison_finds_what_torch_finds(name: str) -> None:
    pull, packed = Pull(PULLS[name]()), False
    steps = _steps(pull, packed)
    image = pull.payload()
    assert _rows(steps, pull.words) is not None  # every step goes to the kernels
    for seed in range(2):
        pull.change(7, seed)
        got, want, mine, theirs = _both(pull, image, packed, most_changed(pull.words))
        assert got is not None and want is not None and got.positions.numel() > 0
        assert torch.equal(got.positions, want.positions) and torch.equal(got.values, want.values)
        assert torch.equal(mine, theirs) and torch.equal(mine, pull.payload())
        image = mine


def test_a_packed_slot_whose_padding_is_dropped_is_left_to_the_finder() -> None:
    pull = Pull(interleaved())
    assert _rows(_steps(pull, True), pull.words) is None


@pytest.mark.parametrize("spare", [0, -1])
def test_at_the_limit_a_delta_one_past_it_nothing_and_the_image_untouched(spare: int) -> None:
    pull = Pull(long_rows())
    image = pull.payload()
    pull.change(9, 3)
    changed = int((image.view(torch.int16) != pull.payload().view(torch.int16)).sum())
    got, want, mine, _ = _both(pull, image, False, changed + spare)
    if spare == 0:
        assert got is not None and want is not None and torch.equal(got.positions, want.positions)
    else:
        assert got is None and want is None and torch.equal(mine, image)


@pytest.mark.parametrize(
    ("shape", "a", "b", "want"),
    [
        ((4, 2, 8), (32, 16, 1), (40, 8, 1), ((4, 2, 8), (32, 16, 1), (40, 8, 1))),  # interleaved stacks
        ((4, 2, 8), (16, 8, 1), (16, 8, 1), ((1, 1, 64), (0, 0, 1), (0, 0, 1))),  # one run in both
        ((3, 5), (9, 1), (5, 1), ((1, 3, 5), (0, 9, 1), (0, 5, 1))),  # a column slice into a packed part
        ((2, 1, 5), (5, 5, 1), (5, 5, 1), ((1, 1, 10), (0, 0, 1), (0, 0, 1))),  # size-1 dims dropped
        ((3, 5), (1, 3), (5, 1), None),  # a transposed source
        ((2, 2, 2, 2), (100, 30, 6, 1), (8, 4, 2, 1), None),  # four dims that do not merge
    ],
)
def test_joint_geometry(shape: tuple, a: tuple, b: tuple, want: tuple | None) -> None:
    assert triton_diff.joint_geometry(shape, a, b) == want


def _landing(seed: int) -> list[torch.Tensor]:
    """Parameters a pull lands in: 5 tensors of their own (one of 1 word) and two parts of one storage."""
    g = torch.Generator().manual_seed(seed)
    own = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (300, 1, 4097, 64, 9)]
    shared = torch.randn(2, 500, generator=g).to(torch.bfloat16)
    return [*own[:2], shared[0], *own[2:4], shared[1], own[4]]


@pytest.mark.parametrize("fraction", [0.0, 0.02, 1.0])
def test_the_triton_scatter_writes_what_torch_writes(fraction: float) -> None:
    mine, theirs = _landing(0), _landing(0)
    words = payload_words([t.numel() * 2 for t in mine])
    g = torch.Generator().manual_seed(1)
    live = torch.cat([torch.arange(p.start, p.start + p.words) for p in words.parts])
    positions = live[torch.rand(live.numel(), generator=g) < fraction] if fraction < 1 else live
    values = torch.randint(-(2**15), 2**15, (positions.numel(),), dtype=torch.int16, generator=g)
    a, b = Scatter.of(mine, words), Scatter.of(theirs, words)
    assert a.flat_shifts is not None
    a.put(positions, values, backend="triton")
    b.put(positions, values, backend="torch")
    for x, y in zip(mine, theirs, strict=True):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    if fraction:
        assert not all(torch.equal(x, y) for x, y in zip(mine, _landing(0), strict=True))
