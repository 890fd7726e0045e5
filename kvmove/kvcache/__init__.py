"""KV cache of a rollout worker: device and host page pools and the radix tree of cached prefixes.

``KVPool`` (device) and ``HostKVPool`` share one ``KVGeometry``; the host pool is what peers move pages between.
``RadixTree`` maps (weight version, extra_key, page-aligned tokens) to page ids of either pool.
"""

from kvmove.kvcache.allocator import PageAllocator, PageIds, pages_to_slots, slots_to_pages
from kvmove.kvcache.checksum import pages_digest
from kvmove.kvcache.geometry import KVGeometry
from kvmove.kvcache.heads import HeadShard, HeadSlice, head_slices, rank_heads, slice_ranges
from kvmove.kvcache.host_pool import HostKVPool
from kvmove.kvcache.pool import KV, KVPool
from kvmove.kvcache.radix import (
    EvictResult,
    InsertResult,
    MatchResult,
    Namespace,
    PathPages,
    RadixKey,
    RadixNode,
    RadixTree,
)

__all__ = [
    "KV",
    "EvictResult",
    "HeadShard",
    "HeadSlice",
    "HostKVPool",
    "InsertResult",
    "KVGeometry",
    "KVPool",
    "MatchResult",
    "Namespace",
    "PageAllocator",
    "PageIds",
    "PathPages",
    "RadixKey",
    "RadixNode",
    "RadixTree",
    "head_slices",
    "pages_digest",
    "pages_to_slots",
    "rank_heads",
    "slice_ranges",
    "slots_to_pages",
]
