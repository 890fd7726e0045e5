"""KV heads across tensor-parallel ranks: which rank holds which heads, and the byte ranges that move a rank's
heads of some pages into another rank's pages when the two workers split the heads differently (resharding).

A page of a layer buffer is ``[page_size, num_kv_heads, head_dim]`` (token-major, as the device pool lays it out),
so the heads ``[a, b)`` of one token are one contiguous run of ``(b - a) * head_bytes`` bytes, and a page of a
rank that holds exactly the heads another needs moves as one run. ``head_slices`` is the pure plan (which source
rank serves which of a target rank's heads); ``slice_ranges`` turns one slice into ``(remote, local, nbytes)``
ranges for a transport, identical for every K and V buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvmove.errors import KVCacheError
from kvmove.kvcache.geometry import KVGeometry


class HeadShard(NamedTuple):
    """KV heads ``start .. start + num - 1`` of a model with ``total`` KV heads, held by one rank."""

    start: int
    num: int
    total: int


def rank_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """The KV heads rank ``tp_rank`` of ``tp_size`` holds: an even split, or one replicated head when
    ``tp_size > total_kv_heads`` (vLLM's and SGLang's rule; ``tp_size`` must divide or be divided by the heads)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise KVCacheError(f"tp rank {tp_rank} of tp size {tp_size}")
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise KVCacheError(f"{total_kv_heads} KV heads cannot be split over tp={tp_size}")
    if tp_size <= total_kv_heads:
        count = total_kv_heads // tp_size
        return HeadShard(tp_rank * count, count, total_kv_heads)
    return HeadShard(tp_rank // (tp_size // total_kv_heads), 1, total_kv_heads)


class HeadSlice(NamedTuple):
    """Heads ``src_head .. src_head + num - 1`` of source rank ``source`` (an index into the sources given to
    ``head_slices``) land at heads ``dst_head ..`` of the target rank; both offsets are local to each rank."""

    source: int
    src_head: int
    dst_head: int
    num: int


def head_slices(target: KVGeometry, sources: Sequence[KVGeometry]) -> list[HeadSlice]:
    """Which source rank serves which of ``target``'s heads: for each head, the first source holding it, runs of
    consecutive heads from one source merged. KVCacheError if the sources miss a head or differ in anything but
    their heads (layers, head dim, page size, dtype, model heads)."""
    for src in sources:
        _check_same_model(target, src)
    out: list[HeadSlice] = []
    for head in range(target.head_start, target.head_stop):
        i = next((i for i, s in enumerate(sources) if s.head_start <= head < s.head_stop), None)
        if i is None:
            raise KVCacheError(f"no source rank holds KV head {head} of {target.model_kv_heads}")
        last = out[-1] if out else None
        if last is not None and last.source == i and last.dst_head + last.num == head - target.head_start:
            out[-1] = last._replace(num=last.num + 1)
        else:
            out.append(HeadSlice(i, head - sources[i].head_start, head - target.head_start, 1))
    return out


def slice_ranges(
    src: KVGeometry, dst: KVGeometry, src_pages: Sequence[int], dst_pages: Sequence[int], piece: HeadSlice
) -> np.ndarray:
    """``(n, 3)`` int64 ``(remote_offset, local_offset, nbytes)`` moving ``piece``'s heads of every token of
    ``src_pages[i]`` (a buffer of ``src``) into ``dst_pages[i]`` (a buffer of ``dst``); whole pages when both ranks
    hold the same heads (the ranges then coalesce into one per run of pages)."""
    if len(src_pages) != len(dst_pages):
        raise KVCacheError(f"{len(src_pages)} source pages for {len(dst_pages)} target pages")
    hb = src.head_bytes
    tokens = np.arange(src.page_size, dtype=np.int64)
    src_tok = (tokens * src.num_kv_heads + piece.src_head) * hb
    dst_tok = (tokens * dst.num_kv_heads + piece.dst_head) * hb
    sp = np.asarray(src_pages, dtype=np.int64)[:, None] * src.page_bytes
    dp = np.asarray(dst_pages, dtype=np.int64)[:, None] * dst.page_bytes
    out = np.empty((len(sp) * src.page_size, 3), dtype=np.int64)
    out[:, 0] = (sp + src_tok).reshape(-1)
    out[:, 1] = (dp + dst_tok).reshape(-1)
    out[:, 2] = piece.num * hb
    return out


def _check_same_model(a: KVGeometry, b: KVGeometry) -> None:
    fields = ("num_layers", "head_dim", "page_size", "dtype", "model_kv_heads")
    diffs = [f"{f} {getattr(a, f)} != {getattr(b, f)}" for f in fields if getattr(a, f) != getattr(b, f)]
    if diffs:
        raise KVCacheError("KV geometry mismatch between ranks: " + ", ".join(diffs))
