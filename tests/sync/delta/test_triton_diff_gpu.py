"""The Triton comparison compiled on a GPU: the same changed words, positions, values and image as the torch
comparison, for a pull of stacked experts (interleaved in the slot), column slices, long vectors and a packed slot.
Its arithmetic is checked on CPU by Triton's interpreter (test_triton_diff_interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from kvmove.sync.delta.diff import diff, program_steps, slot_steps
from kvmove.sync.delta.encoding import most_changed, payload_words
from kvmove.sync.planning.packing import pack_layout
from kvmove.sync.programs import ProgramBuilder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("triton", reason="the Triton comparison needs triton")


def _parts() -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(16, 256, 3000, device="cuda", generator=g).to(torch.bfloat16)[:, :, 100:2148]
    down = torch.randn(16, 512, 1024, device="cuda", generator=g).to(torch.bfloat16)
    norm = torch.randn(4097, device="cuda", generator=g).to(torch.bfloat16)
    return [t for e in range(16) for t in (gate[e], down[e])] + [norm]


@pytest.mark.parametrize("packed", [False, True], ids=["from-sources", "packed-slot"])
def test_compiled_triton_comparison_equals_torch(packed: bool) -> None:
    parts = _parts()
    sizes = [t.numel() * 2 for t in parts]
    words = payload_words(sizes)
    slot = torch.zeros(pack_layout(sizes).nbytes, dtype=torch.uint8, device="cuda")
    b = ProgramBuilder()
    for t, off, n in zip(parts, pack_layout(sizes).offsets, sizes, strict=True):
        b.copy(slot[off : off + n].view(t.dtype).view(t.shape), t)
    program = b.build(persistent=True)
    program.run()
    image = slot.clone()
    g = torch.Generator(device="cuda").manual_seed(1)
    for t in parts:  # about 2% of words, as a training step changes them
        flip = torch.rand(t.shape, device="cuda", generator=g) < 0.02
        t.view(torch.int16)[flip] ^= 1
    if packed:
        program.run()
    steps = slot_steps(slot, words) if packed else program_steps(program, slot, words)
    assert steps is not None
    mine, theirs = image.clone(), image.clone()
    got = diff(steps, mine, words, most_changed(words), backend="triton")
    want = diff(steps, theirs, words, most_changed(words), backend="torch")
    assert got is not None and want is not None and got.positions.numel() > 0
    assert torch.equal(got.positions, want.positions) and torch.equal(got.values, want.values)
    assert torch.equal(mine, theirs)
    program.run()
    assert torch.equal(mine, slot)


def test_compiled_triton_scatter_equals_torch() -> None:
    from kvmove.sync.delta.apply import Scatter

    def landing() -> list[torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(2)
        own = [torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) for n in (3 << 20, 1, 4097)]
        stack = torch.randn(300, 4096, device="cuda", generator=g).to(torch.bfloat16)
        return [own[0], *stack.unbind(), own[1], own[2]]  # 300 parts of one storage between tensors of their own

    mine, theirs = landing(), landing()
    words = payload_words([t.numel() * 2 for t in mine])
    live = torch.cat([torch.arange(p.start, p.start + p.words, device="cuda") for p in words.parts])
    g = torch.Generator(device="cuda").manual_seed(3)
    positions = live[torch.rand(live.numel(), device="cuda", generator=g) < 0.02]
    values = torch.randint(-(2**15), 2**15, (positions.numel(),), dtype=torch.int16, device="cuda", generator=g)
    a, b = Scatter.of(mine, words), Scatter.of(theirs, words)
    assert a.flat_shifts is not None
    a.put(positions, values, backend="triton")
    b.put(positions, values, backend="torch")
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(mine, theirs, strict=True))
