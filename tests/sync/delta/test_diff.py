"""The trainer's comparison straight from a pull's sources: every changed word found, in ascending positions,
where the program's batched copies interleave in the slot, where a packed slot is compared instead, and where
more changed than an encoding carries (nothing gathered, the image left for the caller to refresh)."""

from __future__ import annotations

import pytest
import torch

from kvmove.sync.delta import diff as diff_module
from kvmove.sync.delta.diff import FINDERS, diff, merged, offsets, program_steps, slot_steps
from kvmove.sync.delta.encoding import most_changed, payload_words
from kvmove.sync.planning.packing import pack_layout
from kvmove.sync.programs import Program, ProgramBuilder


@pytest.fixture(autouse=True, params=["cpu", "cuda"])
def finder_of(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with CPU tensors under each device's finder (numpy's passes, and torch's as on CUDA)."""
    monkeypatch.setitem(diff_module.FINDERS, "cpu", FINDERS[request.param])
    return str(request.param)


class Interleaved:
    """A pull of 4 experts' gate (2, 8) and down (3, 8) BF16 weights, in turn in the slot, read from two stacked
    sources: the program copies all gates in one strided copy and all downs in another, whose slot views
    interleave. Plus a 3-element norm (6 bytes: padding follows)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.gate = torch.randn(4, 2, 16, generator=g).to(torch.bfloat16)[:, :, 4:12]  # strided sources
        self.down = torch.randn(4, 3, 8, generator=g).to(torch.bfloat16)
        self.norm = torch.randn(3, generator=g).to(torch.bfloat16)
        self.parts = [t for e in range(4) for t in (self.gate[e], self.down[e])] + [self.norm]
        self.sizes = [t.numel() * 2 for t in self.parts]
        self.words = payload_words(self.sizes)
        self.slot = torch.zeros(pack_layout(self.sizes).nbytes, dtype=torch.uint8)
        self.program = self._program(self.slot)

    def _program(self, buf: torch.Tensor) -> Program:
        b = ProgramBuilder()
        for t, off, n in zip(self.parts, pack_layout(self.sizes).offsets, self.sizes, strict=True):
            b.copy(buf[off : off + n].view(torch.bfloat16).view(t.shape), t)
        return b.build(persistent=True)

    def payload(self) -> torch.Tensor:
        """The dense payload (packed into a buffer of its own)."""
        buf = torch.zeros_like(self.slot)
        self._program(buf).run()
        return buf

    def change(self, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in (self.gate, self.down, self.norm):
            flat = t.view(torch.int16)
            for _ in range(count):
                index = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in t.shape)
                flat[index] ^= 1 << int(torch.randint(0, 16, (1,), generator=g))


def _expected(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return (old.view(torch.int16) != new.view(torch.int16)).nonzero().flatten()


def test_interleaved_copies_give_every_changed_word_in_ascending_positions() -> None:
    pull = Interleaved()
    steps = program_steps(pull.program, pull.slot, pull.words)
    assert steps is not None and steps.order is not None and len(steps.steps) == 3  # gates, downs, the norm
    image = pull.payload()
    for seed in range(3):
        old = image.clone()
        pull.change(5, seed)
        new = pull.payload()
        got = diff(steps, image, pull.words, most_changed(pull.words))
        assert got is not None
        want = _expected(old, new)
        assert torch.equal(got.positions, want)
        assert torch.equal(got.values, new.view(torch.int16)[want])
        assert torch.equal(image, new)  # the image took the changed words, and only those were different


def test_a_packed_slot_is_compared_without_its_padding() -> None:
    """The padding differs between the slot and the image: it is never reported, and the image keeps its own."""
    pull = Interleaved()
    image = pull.payload()
    old = image.clone()
    pull.change(3, 7)
    pull.program.run()
    end = pack_layout(pull.sizes).offsets[-1] + 6
    pull.slot[end:] = 0xEE  # the padding after the norm, as an earlier delta left it
    got = diff(slot_steps(pull.slot, pull.words), image, pull.words, most_changed(pull.words))
    new = pull.payload()
    assert got is not None and torch.equal(got.positions, _expected(old, new))
    assert torch.equal(got.values, new.view(torch.int16)[got.positions])
    assert torch.equal(image, new)  # the image's padding was never written


@pytest.mark.parametrize("spare", [0, -1])
def test_near_the_limit_the_changed_words_are_counted_exactly(spare: int) -> None:
    """The changed words are counted exactly: at the limit the pull is still a delta, one past it nothing is
    gathered, the image untouched."""
    pull = Interleaved()
    image = pull.payload()
    steps = program_steps(pull.program, pull.slot, pull.words)
    assert steps is not None
    old = image.clone()
    pull.change(4, 5)
    changed = _expected(old, pull.payload()).numel()
    got = diff(steps, image, pull.words, limit=changed + spare)
    if spare == 0:
        assert got is not None and got.positions.numel() == changed and torch.equal(image, pull.payload())
    else:
        assert got is None and torch.equal(image, old)


def test_past_the_limit_nothing_is_gathered_and_the_image_is_left_as_it_was() -> None:
    pull = Interleaved()
    image = pull.payload()
    old = image.clone()
    steps = program_steps(pull.program, pull.slot, pull.words)
    assert steps is not None
    pull.change(40, 3)
    assert diff(steps, image, pull.words, limit=4) is None
    assert torch.equal(image, old)


def test_a_program_that_quantizes_converts_or_moves_narrow_elements_is_compared_packed() -> None:
    words = payload_words([64])
    slot = torch.zeros(64, dtype=torch.uint8)
    narrow = ProgramBuilder()
    narrow.copy(slot[:63].view(3, 21)[:, :1], torch.zeros(3, 1, dtype=torch.uint8))  # bytes, under int16 words
    assert program_steps(narrow.build(persistent=True), slot, words) is None
    converts = ProgramBuilder()
    converts.copy(slot[:32].view(torch.bfloat16), torch.ones(16))  # FP32 -> BF16
    assert program_steps(converts.build(persistent=True), slot, words) is None
    quantizes = ProgramBuilder()
    quantizes.quantize(torch.ones(128, 128, dtype=torch.bfloat16), "w")
    assert program_steps(quantizes.build(persistent=False), slot, words) is None


@pytest.mark.parametrize(
    ("shape", "stride", "want"),
    [
        ((2, 3, 4), (12, 4, 1), ((24,), (1,))),
        ((2, 3, 4), (20, 4, 1), ((2, 12), (20, 1))),
        ((1, 5), (9, 2), ((5,), (2,))),
    ],
)
def test_merged_geometry(shape: tuple, stride: tuple, want: tuple) -> None:
    assert merged(shape, stride) == want
    view = torch.arange(100).as_strided(shape, stride)
    index = torch.arange(view.numel())
    assert torch.equal(offsets(index, *merged(shape, stride)), view.reshape(-1))
