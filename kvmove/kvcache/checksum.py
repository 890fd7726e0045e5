"""Checksums of KV pages: what a migration source computes over the pages it staged and the target recomputes
over what it is about to cache, so corrupted or overwritten pages never become cached K/V.

The digest covers, buffer after buffer (K of every layer, then V of every layer), the bytes of the pages in the
order given, every token with all the model's KV heads in order: the parts of a worker's tensor-parallel ranks
(each its own heads, in head order) are joined along the heads. So host and device pools, and workers of any tensor
parallelism, give equal digests for equal K/V.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

DIGEST = "blake2b-128"

RankPages = tuple[Sequence[torch.Tensor], torch.Tensor]
"""One rank's part: its ``[num_pages, page_size, heads, head_dim]`` buffer views and the page ids to cover."""


def pages_digest(parts: Sequence[RankPages]) -> str:
    """Hex digest of the pages of every rank's part (ranks in head order, equally many pages each)."""
    h = hashlib.blake2b(digest_size=16)
    for b in range(len(parts[0][0])):
        pieces = [views[b][pages.to(views[b].device)] for views, pages in parts]
        chunk = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
        h.update(chunk.contiguous().view(-1).view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()
