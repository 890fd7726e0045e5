"""A broadcast root's sends, kept as five sums, give back the line they were timed on."""

from __future__ import annotations

import pytest

from kvmove.sync.ranks.calltimes import MIN_CALLS, CallTimes


def _timed(fixed: float, per_byte: float, sizes: list[int], noise: float = 0.0) -> CallTimes:
    sends = CallTimes()
    for i, nbytes in enumerate(sizes):
        wobble = noise * (1 if i % 2 else -1)
        sends = sends.add(nbytes, fixed + nbytes * per_byte + wobble)
    return sends


def test_the_sums_give_back_the_line_of_the_calls() -> None:
    sends = _timed(7e-4, 2e-9, [64, 4096, 300_000, 8 << 20] * 5)
    line = sends.fit()
    assert line is not None
    assert line.fixed == pytest.approx(7e-4) and line.per_byte == pytest.approx(2e-9)
    assert sends.calls == 20 and sends.bytes == pytest.approx(5 * (64 + 4096 + 300_000 + (8 << 20)))


def test_noise_moves_the_line_little() -> None:
    line = _timed(7e-4, 2e-9, [64, 4096, 300_000, 8 << 20] * 25, noise=5e-5).fit()
    assert (
        line is not None
        and line.fixed == pytest.approx(7e-4, rel=0.1)
        and line.per_byte == pytest.approx(2e-9, rel=0.01)
    )


@pytest.mark.parametrize(
    "sends",
    [
        CallTimes(),
        _timed(7e-4, 2e-9, [64, 8 << 20] * ((MIN_CALLS - 1) // 2)),  # too few calls
        _timed(7e-4, 2e-9, [4096] * 20),  # one size: nothing tells the fixed cost from the bytes
        _timed(7e-4, -1e-11, [64, 4096, 300_000] * 10),  # bigger sends faster: no rate
        _timed(-1e-4, 2e-9, [64, 4096, 300_000] * 10),  # a negative fixed cost
    ],
)
def test_calls_that_cannot_give_a_line_give_none(sends: CallTimes) -> None:
    assert sends.fit() is None


def test_the_sums_cross_as_json_and_back() -> None:
    sends = _timed(7e-4, 2e-9, [64, 4096, 300_000, 8 << 20] * 5)
    assert CallTimes(**sends.as_json()) == sends
