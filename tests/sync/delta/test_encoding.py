"""The delta encodings: sizes, the choice between them, and exact round trips of their bytes."""

from __future__ import annotations

import pytest
import torch

from kvmove.sync.delta.encoding import (
    GAP_LIMIT,
    Encoding,
    Span,
    bit_positions,
    choose,
    delta_bytes,
    encoded_bytes,
    longest_gap,
    most_changed,
    payload_words,
    read,
    write,
)


def test_payload_words_know_each_part_and_the_padding_between() -> None:
    words = payload_words([32, 6, 0, 16])  # offsets 0, 32, 48, 48: 6 bytes then 10 of padding; an empty part
    assert words.dtype == torch.int16 and words.dense_bytes == 64 and words.words == 32
    assert words.parts == (Span(0, 16), Span(16, 3), Span(24, 8)) and words.live_words == 27
    assert words.starts("cpu").tolist() == [0, 16, 24]
    odd = payload_words([3, 16])
    assert odd.dtype == torch.uint8 and odd.parts == (Span(0, 3), Span(16, 16))


@pytest.mark.parametrize("fraction", [0.0, 1e-4, 0.003, 0.01, 0.03, 0.1, 0.3, 0.5, 0.9, 0.99, 1.0])
def test_a_delta_is_never_larger_than_dense(fraction: float) -> None:
    dense = 1 << 20
    got = delta_bytes(dense, fraction)
    assert got <= dense
    if fraction <= 0.03:
        assert got <= 0.2 * dense


def test_the_smallest_encoding_wins_at_each_changed_fraction() -> None:
    words = payload_words([1 << 20])
    n = words.words
    assert choose(words, 0, 0) is Encoding.INDEX  # nothing changed: an empty delta
    assert encoded_bytes(words, 0, Encoding.INDEX) == encoded_bytes(words, 0, Encoding.GAPS) == 0
    assert choose(words, n // 100, 400) is Encoding.GAPS  # 1%: 4 bytes a change beat 6, and a bit a word
    assert choose(words, n // 100, GAP_LIMIT + 1) is Encoding.INDEX  # a gap too long for 16 bits
    assert choose(words, n // 20, 40) is Encoding.GAPS  # 5%: 2 bytes a change, below 1/16 of a word's 16 bits
    assert choose(words, n // 10, 40) is Encoding.BITMAP  # 10%: the bits are fewer
    assert choose(words, n, 1) is Encoding.DENSE  # everything changed
    assert choose(words, int(n * 0.95), 2) is Encoding.DENSE  # the bitmap's bits on top: dense is smaller
    with pytest.raises(ValueError, match="not in"):
        delta_bytes(100, 1.5)


def test_longest_gap_counts_from_before_the_first_word() -> None:
    assert longest_gap(torch.tensor([0, 1, 2])) == 1 and longest_gap(torch.tensor([5, 6])) == 6
    assert longest_gap(torch.tensor([], dtype=torch.int64)) == 0


def test_most_changed_is_where_the_encodings_stop_being_smaller() -> None:
    for sizes in ([1 << 20], [64], [6], [30, 2, 100]):
        words = payload_words(sizes)
        k = most_changed(words)
        assert choose(words, k, 1) is not Encoding.DENSE and choose(words, k + 1, 1) is Encoding.DENSE


def test_bit_positions_expand_only_the_bytes_with_a_bit_set() -> None:
    mask = torch.rand(1001) < 0.3
    mask[0] = mask[1000] = True
    padded = torch.zeros(1008, dtype=torch.uint8)
    padded[:1001] = mask
    bits = (padded.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)
    assert torch.equal(bit_positions(bits, int(mask.sum())), mask.nonzero().flatten())
    assert bit_positions(torch.zeros(4, dtype=torch.uint8), 0).numel() == 0


@pytest.mark.parametrize("encoding", [Encoding.INDEX, Encoding.GAPS, Encoding.BITMAP])
@pytest.mark.parametrize("changed", [0, 1, 57, 303])
def test_write_then_read_gives_the_changed_words_back(encoding: Encoding, changed: int) -> None:
    sizes = [400, 6, 200]
    words = payload_words(sizes)
    room = max(words.dense_bytes, encoded_bytes(words, changed, encoding))  # a sync writes only what is smaller
    buf = torch.randint(0, 255, (room,), dtype=torch.uint8)
    live = torch.cat([torch.arange(p.start, p.start + p.words) for p in words.parts])
    positions = live[torch.randperm(live.numel())[:changed]].sort().values
    values = torch.randint(-(2**15), 2**15, (changed,), dtype=torch.int16)
    nbytes = write(buf, words, encoding, positions, values)
    assert nbytes == encoded_bytes(words, changed, encoding)
    got = read(buf, words, encoding, changed)
    assert torch.equal(got.positions, positions) and torch.equal(got.values, values)


def test_gaps_round_trip_at_the_longest_gap_they_store() -> None:
    words = payload_words([1 << 18])
    positions = torch.tensor([GAP_LIMIT - 1, 2 * GAP_LIMIT - 1, 2 * GAP_LIMIT, (1 << 17) - 1 + GAP_LIMIT])
    assert longest_gap(positions) == GAP_LIMIT and choose(words, 4, GAP_LIMIT) is Encoding.INDEX  # a tie: index
    buf = torch.zeros(words.dense_bytes, dtype=torch.uint8)
    values = torch.tensor([1, -1, 2**15 - 1, -(2**15)], dtype=torch.int16)
    assert write(buf, words, Encoding.GAPS, positions, values) == 16 + 8
    got = read(buf, words, Encoding.GAPS, 4)
    assert torch.equal(got.positions, positions) and torch.equal(got.values, values)
