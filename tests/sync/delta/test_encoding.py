"""The delta encodings: sizes, the choice between them, and exact round trips of their bytes."""

from __future__ import annotations

import pytest
import torch

from kvmove.sync.delta.encoding import (
    Encoding,
    Span,
    choose,
    delta_bytes,
    encoded_bytes,
    live,
    pack_bits,
    payload_words,
    positions,
    read,
    unpack_bits,
    write,
)


def test_payload_words_skip_alignment_padding_and_merge_adjacent_parts() -> None:
    words = payload_words([32, 6, 16])  # offsets 0, 32, 48: 6 bytes then 10 of padding
    assert words.dtype == torch.int16 and words.dense_bytes == 64
    assert words.spans == (Span(0, 19), Span(24, 8)) and words.live_words == 27
    odd = payload_words([3, 16])
    assert odd.dtype == torch.uint8 and odd.spans == (Span(0, 3), Span(16, 16))


def test_positions_map_live_words_back_into_the_payload() -> None:
    words = payload_words([32, 6, 16])
    got = positions(words, torch.tensor([0, 18, 19, 26]))
    assert got.tolist() == [0, 18, 24, 31]


@pytest.mark.parametrize("fraction", [0.0, 1e-4, 0.003, 0.01, 0.03, 0.1, 0.3, 0.5, 0.9, 0.99, 1.0])
def test_a_delta_is_never_larger_than_dense(fraction: float) -> None:
    dense = 1 << 20
    got = delta_bytes(dense, fraction)
    assert got <= dense
    if fraction <= 0.03:
        assert got <= 0.2 * dense


def test_the_smallest_encoding_wins_at_each_changed_fraction() -> None:
    words = payload_words([1 << 20])
    n = words.live_words
    assert choose(words, 0) is Encoding.INDEX  # nothing changed: an empty delta
    assert encoded_bytes(words, 0, Encoding.INDEX) == 0
    assert choose(words, n // 100) is Encoding.INDEX  # 1%: 6 bytes a change beat a bit a word
    assert choose(words, n // 20) is Encoding.BITMAP  # 5%
    assert choose(words, n) is Encoding.DENSE  # everything changed
    assert choose(words, int(n * 0.95)) is Encoding.DENSE  # the bitmap's bits on top: dense is smaller
    with pytest.raises(ValueError, match="not in"):
        delta_bytes(100, 1.5)


def test_bits_round_trip() -> None:
    mask = torch.rand(1001) < 0.3
    bits = pack_bits(mask)
    assert bits.numel() == 126 and torch.equal(unpack_bits(bits, 1001), mask)


@pytest.mark.parametrize("encoding", [Encoding.INDEX, Encoding.BITMAP])
@pytest.mark.parametrize("changed", [0, 1, 57, 303])
def test_write_then_read_gives_the_changed_words_back(encoding: Encoding, changed: int) -> None:
    sizes = [400, 6, 200]
    words = payload_words(sizes)
    room = max(words.dense_bytes, encoded_bytes(words, changed, encoding))  # a sync writes only what is smaller
    buf = torch.randint(0, 255, (room,), dtype=torch.uint8)
    old = live(buf, words).clone()
    new = old.clone()
    index = torch.randperm(old.numel())[:changed].sort().values
    new[index] = new[index] ^ 0x1  # flip the lowest bit of each changed word
    mask = new != old
    assert int(mask.sum()) == changed
    nbytes = write(buf, words, encoding, mask, index, new[index])
    assert nbytes == encoded_bytes(words, changed, encoding)
    got_index, values = read(buf, words, encoding, changed)
    assert torch.equal(got_index, index) and torch.equal(values, new[index])
