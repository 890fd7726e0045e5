"""Seeded bytes and shuffled ranges for the transports' bit-exact checks: a helper module, not a conftest, so its
name is unique across the test folders and any set of them runs in one pytest call."""

from __future__ import annotations

import itertools

import numpy as np
import torch

NBYTES = 1 << 20  # per buffer; small so the folder stays quick on 2 cores
SEED = 1234


def seeded_bytes(nbytes: int = NBYTES, seed: int = 0) -> torch.Tensor:
    """The bytes ``bandwidth.Peer`` fills a server buffer with."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def random_ranges(seed: int, count: int = 7, nbytes: int = NBYTES) -> list[tuple[int, int, int]]:
    """Disjoint, shuffled ``(remote_offset, local_offset, nbytes)`` ranges of varied sizes, including 1-byte ones."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, nbytes), size=2 * count - 1, replace=False))
    bounds = np.concatenate(([0], cuts, [nbytes]))
    pieces = [(int(a), int(b - a)) for a, b in itertools.pairwise(bounds)]
    local = pieces[::2]
    remote = rng.permutation(len(pieces))[:count]
    ranges = [(pieces[r][0], lo, min(pieces[r][1], n)) for r, (lo, n) in zip(remote, local, strict=True)]
    ranges.append((nbytes - 1, local[0][0], 1))
    return [r for r in ranges if r[2] > 0][: count + 1]


def expected_after(ranges: list[tuple[int, int, int]], source: torch.Tensor, nbytes: int = NBYTES) -> torch.Tensor:
    out = torch.zeros(nbytes, dtype=torch.uint8)
    for ro, lo, n in ranges:
        out[lo : lo + n] = source[ro : ro + n]
    return out
