"""A rank's migration session: its host KV endpoint as the handshake publishes it, and the peer checks.

Two ranks may exchange K/V only if their geometries (layers, KV heads, head dim, page size, dtype), weight
versions and transports are equal; ``check_peer`` raises PeerMismatchError naming every difference, before anything
is allocated or moved.
"""

from __future__ import annotations

import torch

from kvmove.kvcache import KVGeometry
from kvmove.migration.errors import PeerMismatchError
from kvmove.migration.messages import GeometryInfo, RankSession, TransferTarget


def geometry_info(g: KVGeometry) -> GeometryInfo:
    return GeometryInfo(
        num_layers=g.num_layers,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        page_size=g.page_size,
        dtype=str(g.dtype).removeprefix("torch."),
    )


def parse_geometry(info: GeometryInfo) -> KVGeometry:
    dtype = getattr(torch, info.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise PeerMismatchError(f"peer KV dtype {info.dtype!r} is not a torch dtype")
    return KVGeometry(info.num_layers, info.num_kv_heads, info.head_dim, info.page_size, dtype)


def check_compatible(local: KVGeometry, local_version: str, peer: GeometryInfo, peer_version: str | None) -> None:
    """PeerMismatchError naming every field in which the peer differs (weight version included)."""
    mine = geometry_info(local).model_dump()
    diffs = [f"{k} {mine[k]} != {v}" for k, v in peer.model_dump().items() if mine[k] != v]
    if peer_version is not None and peer_version != local_version:
        diffs.append(f"weight_version {local_version!r} != {peer_version!r}")
    if diffs:
        raise PeerMismatchError("peer KV cache mismatch: " + ", ".join(diffs))


def check_peer(local: RankSession, peer: RankSession) -> None:
    """Handshake check between two ranks' session infos (both from ``/get_transfer_session_ids``)."""
    if local.geometry is None or peer.geometry is None:
        raise PeerMismatchError("peer session has no geometry: not a kvmove server, cannot validate the peer")
    check_compatible(parse_geometry(local.geometry), local.weight_version or "", peer.geometry, peer.weight_version)
    check_layout(local, peer.host_kv_data_ptrs, peer.host_kv_item_lens)
    check_transport(local.transport, peer.transport)


def check_transport(local: str | None, peer: str | None) -> None:
    """Both ranks must move K/V over the same transport (checked where both say which: SGLang peers do not)."""
    if local and peer and local != peer:
        raise PeerMismatchError(
            f"peer transport mismatch: the peer moves KV over {peer!r}, this rank over {local!r} "
            "(start both servers with the same --transport)"
        )


def check_layout(local: RankSession, data_ptrs: list[int], item_lens: list[int]) -> None:
    """The peer's host buffers must be as many and as long per page as ours (catches SGLang-only clients too)."""
    if len(data_ptrs) != len(local.host_kv_data_ptrs) or len(item_lens) != len(data_ptrs):
        raise PeerMismatchError(
            f"peer has {len(data_ptrs)} host KV buffers ({len(item_lens)} item lens), "
            f"this rank has {len(local.host_kv_data_ptrs)}: layer count differs"
        )
    if item_lens != local.host_kv_item_lens:
        raise PeerMismatchError(
            f"peer host_kv_item_lens {item_lens[:2]}... != {local.host_kv_item_lens[:2]}... bytes per page: "
            "page size, KV heads, head dim or dtype differ"
        )


def target_for_rank(targets: list[TransferTarget], tp: int, pp: int) -> TransferTarget:
    found = [t for t in targets if (t.tp, t.pp) == (tp, pp)]
    if len(found) != 1:
        raise PeerMismatchError(f"no single target entry for rank tp={tp} pp={pp} ({len(found)} given)")
    return found[0]
