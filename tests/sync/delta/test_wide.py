"""The CPU's 64-bit-first comparison of a packed slot: the same changes, image and refusals as comparing word by
word, for int16 and byte words, tails shorter than a wide word, padding inside differing wide words, bit
patterns that compare equal as values, nothing and everything changed, and the limit counted exactly."""

from __future__ import annotations

import pytest
import torch

from kvmove.sync.delta import wide
from kvmove.sync.delta.diff import Flat, Step, Steps, diff
from kvmove.sync.delta.encoding import Changes, Words
from kvmove.sync.delta.wide import compare


def _reference(new: torch.Tensor, image: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    changed = new != image[: new.numel() * new.element_size()].view(new.dtype)
    changed[padding] = False
    return changed.nonzero().flatten()


def _case(nbytes: int, dtype: torch.dtype, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    new = image.clone()
    flips = torch.rand(nbytes, generator=g) < fraction
    new[flips] ^= torch.randint(1, 256, (int(flips.sum()),), dtype=torch.uint8, generator=g)
    return new.view(dtype) if dtype == torch.int16 else new, image


def _check_outcome(
    got: Changes | None,
    accepted: bool,
    new: torch.Tensor,
    image: torch.Tensor,
    old: torch.Tensor,
    padding: torch.Tensor,
    want: torch.Tensor,
) -> None:
    """Accepted: the reference changes, and the image is the new bytes with its padding words as they were.
    Refused: nothing, and the image as it was."""
    if not accepted:
        assert got is None and torch.equal(image, old)
        return
    assert got is not None and torch.equal(got.positions, want) and torch.equal(got.values, new[want])
    expected = new.view(torch.uint8).clone()
    expected.view(torch.int16)[padding] = old.view(torch.int16)[padding]
    assert torch.equal(image, expected)


@pytest.mark.parametrize(
    ("nbytes", "dtype"),
    [(4096, torch.int16), (4102, torch.int16), (4099, torch.uint8), (6, torch.int16), (8, torch.uint8)],
)
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
def test_the_same_changes_and_image_as_word_by_word(nbytes: int, dtype: torch.dtype, fraction: float) -> None:
    new, image = _case(nbytes, dtype, fraction, seed=nbytes)
    words = new.numel()
    padding = torch.tensor(sorted({p for p in (0, 5, words // 2, words - 1) if p < words}), dtype=torch.int64)
    want, old = _reference(new, image, padding), image.clone()
    got = compare(new, image, padding, limit=words)
    assert got is not None
    assert torch.equal(got.positions, want) and got.positions.dtype == torch.int64
    assert torch.equal(got.values, new[want]) and got.values.dtype == new.dtype
    expected = new.view(torch.uint8).clone()
    expected.view(dtype)[padding] = old[:nbytes].view(dtype)[padding]  # the image keeps its own padding
    assert torch.equal(image, expected)


def test_nan_payloads_and_signed_zeros_are_compared_as_bits() -> None:
    old = torch.tensor([0.0, float("nan"), 1.0, 2.0, 0.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0
    new.view(torch.int16)[1] |= 1  # another NaN payload
    image = old.view(torch.int16).view(torch.uint8).clone()
    got = compare(new.view(torch.int16), image, None, limit=9)
    assert got is not None and got.positions.tolist() == [0, 1]
    assert torch.equal(image.view(torch.int16), new.view(torch.int16))


def test_a_lone_changed_word_in_a_padded_wide_word_is_found() -> None:
    new, image = _case(64, torch.int16, 0.0, seed=1)
    new[9] ^= 1  # real change
    new[10] ^= 1  # padding, differs
    new[11] ^= 1  # padding, differs: the wide word 8..11 differs in two padding lanes and one real
    got = compare(new, image, torch.tensor([10, 11]), limit=1)
    assert got is not None and got.positions.tolist() == [9]


@pytest.mark.parametrize("spare", [0, -1])
def test_the_limit_is_counted_exactly_and_nothing_is_written_past_it(spare: int) -> None:
    new, image = _case(1030, torch.int16, 0.05, seed=3)
    padding = torch.tensor([1, 2, 3], dtype=torch.int64)
    new.view(torch.int16)[1:4] ^= 7  # padding that differs fills a wide word: never counted
    changed = _reference(new, image, padding).numel()
    old = image.clone()
    got = compare(new, image, padding, limit=changed + spare)
    if spare == 0:
        assert got is not None and got.positions.numel() == changed
    else:
        assert got is None and torch.equal(image, old)


def test_nothing_changed_against_a_limit_of_none() -> None:
    new, image = _case(256, torch.int16, 0.0, seed=4)
    assert compare(new, image, None, limit=-1) is None
    got = compare(new, image, None, limit=0)
    assert got is not None and got.positions.numel() == 0 and got.values.numel() == 0


@pytest.mark.parametrize("limit_spare", [None, -1])
def test_chunks_join_and_a_refusal_in_a_later_chunk_puts_the_earlier_ones_back(
    limit_spare: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compared 8 wide words at a time (padding in several chunks, one straddling lanes of a chunk's last wide
    word): the same changes as word by word; refused by the last chunk, every chunk written before is undone."""
    monkeypatch.setattr(wide, "CHUNK", 8)
    new, image = _case(1030, torch.int16, 0.02, seed=5)
    padding = torch.tensor([3, 30, 31, 62, 200, 513], dtype=torch.int64)
    new[padding] ^= 3  # every padding word differs
    want, old = _reference(new, image, padding), image.clone()
    limit = want.numel() if limit_spare is None else want.numel() + limit_spare
    got = compare(new, image, padding, limit)
    _check_outcome(got, limit_spare is None, new, image, old, padding, want)


@pytest.mark.parametrize("spare", [0, -1])
def test_a_pull_that_changed_nearly_everywhere_is_compared_by_the_finders_passes(
    spare: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where most of the first chunk's wide words differ, the wide comparison declines (``suits``) and nothing is
    gathered by wide word: the CPU finder's own passes find the same changes word by word (differing padding not
    counted), and one past the limit, refuse with the image as it was."""
    monkeypatch.setattr(wide, "CHUNK", 8)
    gathered: list[int] = []
    chunk = wide._chunk
    monkeypatch.setattr(wide, "_chunk", lambda *a: gathered.append(a[3]) or chunk(*a))
    new, image = _case(1030, torch.int16, 0.5, seed=6)
    padding = torch.tensor([40, 41, 300], dtype=torch.int64)
    new[padding] ^= 5
    want, old = _reference(new, image, padding), image.clone()
    assert not wide.suits(new, image) and wide.suits(new, new.view(torch.uint8).clone())
    line = ((new.numel(),), (1,))
    step = Step(new, Flat.of(new), line, Flat(new.view(torch.uint8), 0, line), (0,))
    steps = Steps((step,), None, packed=True, padding=padding, tables={})
    words = Words(torch.int16, (), new.numel() * 2)
    got = diff(steps, image, words, want.numel() + spare, backend="torch")
    assert gathered == []
    _check_outcome(got, spare == 0, new, image, old, padding, want)
