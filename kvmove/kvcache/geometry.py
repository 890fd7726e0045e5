"""KV geometry: the shape of one rank's paged KV cache, shared by its device pool, its host pool and its peers."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvmove.errors import KVCacheError


@dataclass(frozen=True)
class KVGeometry:
    """Per rank: ``num_layers`` layers, each with a K and a V buffer of ``[tokens, num_kv_heads, head_dim]``.

    Two pools can exchange pages only if their geometries are equal (``check_compatible``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise KVCacheError(f"KV geometry: {name} must be >= 1, got {getattr(self, name)}")
        if self.dtype.is_complex or self.dtype == torch.bool:
            raise KVCacheError(f"KV geometry: unsupported dtype {self.dtype}")

    @property
    def token_shape(self) -> tuple[int, int]:
        """Shape of one token's K (or V) in one layer."""
        return (self.num_kv_heads, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer buffer (K or V): the item length a transport moves per page."""
        return self.token_bytes * self.page_size

    @property
    def num_buffers(self) -> int:
        """Layer buffers per pool: K of every layer, then V of every layer."""
        return 2 * self.num_layers

    def check_compatible(self, other: KVGeometry, what: str = "peer") -> None:
        """Raise KVCacheError naming every field in which ``other`` differs from this geometry."""
        diffs = [
            f"{f.name} {getattr(self, f.name)} != {getattr(other, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise KVCacheError(f"KV geometry mismatch with {what}: " + ", ".join(diffs))
