"""KV geometry: the shape of one rank's paged KV cache, shared by its device pool, its host pool and its peers."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvmove.errors import KVCacheError


@dataclass(frozen=True)
class KVGeometry:
    """Per rank: ``num_layers`` layers, each with a K and a V buffer of ``[tokens, num_kv_heads, head_dim]``.

    A tensor-parallel rank holds KV heads ``head_start .. head_start + num_kv_heads - 1`` of the model's
    ``total_kv_heads`` (0: the rank holds them all). Two pools can exchange whole pages only if their geometries
    are equal (``check_compatible``); ranks of different TP exchange head slices of pages (``kvmove.kvcache.heads``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.bfloat16
    head_start: int = 0
    total_kv_heads: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise KVCacheError(f"KV geometry: {name} must be >= 1, got {getattr(self, name)}")
        if self.dtype.is_complex or self.dtype == torch.bool:
            raise KVCacheError(f"KV geometry: unsupported dtype {self.dtype}")
        if self.head_start < 0 or self.head_start + self.num_kv_heads > self.model_kv_heads:
            raise KVCacheError(
                f"KV geometry: heads {self.head_start}..{self.head_start + self.num_kv_heads - 1} "
                f"outside the model's {self.model_kv_heads}"
            )

    @property
    def model_kv_heads(self) -> int:
        """KV heads of the whole model (every rank together)."""
        return self.total_kv_heads or self.num_kv_heads

    @property
    def head_stop(self) -> int:
        return self.head_start + self.num_kv_heads

    @property
    def head_bytes(self) -> int:
        """Bytes of one token's K (or V) of one head in one layer."""
        return self.head_dim * self.dtype.itemsize

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
