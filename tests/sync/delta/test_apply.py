"""The engine's scatter of a delta straight into its parameters: strided regions, FP8 bytes under int16 words,
storages that come back after another's parts, and nothing outside the changed words written."""

from __future__ import annotations

import pytest
import torch

from kvmove.quant import FP8_DTYPE
from kvmove.sync.delta.apply import Patch, Scatter
from kvmove.sync.delta.encoding import Encoding, payload_words, write
from kvmove.sync.planning.packing import pack_layout


def _pull() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters (w13 fused, an FP8 weight, a norm) and the destination of each part, in payload order: a
    strided column slice of w13, the FP8 weight, the norm, then w13's other half (its storage again)."""
    w13 = torch.zeros(8, 12, dtype=torch.bfloat16)
    fp8 = torch.zeros(4, 16, dtype=FP8_DTYPE)
    norm = torch.zeros(6, dtype=torch.bfloat16)
    return [w13, fp8, norm], [w13[:4, 2:7], fp8, norm[1:4], w13[4:]]


@pytest.mark.parametrize("encoding", [Encoding.INDEX, Encoding.GAPS, Encoding.BITMAP])
def test_changed_words_land_in_their_regions_and_nothing_else_moves(encoding: Encoding) -> None:
    params, dsts = _pull()
    sizes = [d.numel() * d.element_size() for d in dsts]
    words = payload_words(sizes)
    scatter = Scatter.of(dsts, words)
    assert scatter.unit == torch.uint8 and scatter.split == 2  # FP8 bytes under int16 words
    assert scatter.geometry is not None and scatter.runs == (0, 1, 2, 0)
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.view(torch.uint8).copy_(torch.randint(0, 256, p.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    layout = pack_layout(sizes)
    payload = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for d, off, n in zip(dsts, layout.offsets, sizes, strict=True):
        payload[off : off + n].copy_(d.contiguous().view(-1).view(torch.uint8))
    before = [p.clone() for p in params]
    live = torch.cat([torch.arange(p.start, p.start + p.words) for p in words.parts])
    positions = live[torch.randperm(live.numel(), generator=g)[:40]].sort().values
    new = payload.view(torch.int16).clone()
    new[positions] = torch.randint(-(2**15), 2**15, (40,), generator=g, dtype=torch.int16)
    buf = torch.zeros(layout.nbytes * 2, dtype=torch.uint8)
    write(buf, words, encoding, positions, new[positions])
    patch = Patch.of(str(encoding), 40, sizes)
    assert patch is not None
    patch.apply(patch.target(dsts), buf)
    for d, off, n in zip(dsts, layout.offsets, sizes, strict=True):
        assert torch.equal(d.contiguous().view(-1).view(torch.uint8), new.view(torch.uint8)[off : off + n])
    outside = [params[0][:4, :2], params[0][:4, 7:], params[2][:1], params[2][4:]]
    kept = [before[0][:4, :2], before[0][:4, 7:], before[2][:1], before[2][4:]]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outside, kept, strict=True))


def test_contiguous_bf16_parts_scatter_as_words() -> None:
    a, b = torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16)
    scatter = Scatter.of([a, b], payload_words([24, 10]))
    assert scatter.unit == torch.int16 and scatter.geometry is None and scatter.runs == (0, 1)
    scatter.put(torch.tensor([0, 11, 16, 20]), torch.tensor([1, 2, 3, 4], dtype=torch.int16))  # b starts at 16
    assert a.view(torch.int16).view(-1)[[0, 11]].tolist() == [1, 2] and b.view(torch.int16)[[0, 4]].tolist() == [3, 4]
    assert int(a.view(torch.int16).count_nonzero()) == 2 and int(b.view(torch.int16).count_nonzero()) == 2
