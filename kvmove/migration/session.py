"""A rank's migration session: its host KV endpoint as the handshake publishes it, and the peer checks.

Two ranks may exchange K/V only if their model's KV geometry (layers, KV heads of the whole model, head dim, page
size, dtype), weight versions and transports are equal; which KV heads each rank holds may differ (workers of
different tensor parallelism: the target rank reads the heads it holds from the source ranks that hold them).
``check_peer`` raises PeerMismatchError naming every difference, before anything is allocated or moved.
"""

from __future__ import annotations

import torch

from kvmove.errors import KVCacheError
from kvmove.kvcache import KVGeometry
from kvmove.migration.errors import PeerMismatchError
from kvmove.migration.messages import GeometryInfo, RankSession, TransferTarget

MODEL_FIELDS = ("num_layers", "head_dim", "page_size", "dtype", "model_kv_heads")
"""What every rank of two peers must share; ``num_kv_heads``/``head_start`` (the rank's own share) may differ."""


def geometry_info(g: KVGeometry) -> GeometryInfo:
    return GeometryInfo(
        num_layers=g.num_layers,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        page_size=g.page_size,
        dtype=str(g.dtype).removeprefix("torch."),
        head_start=g.head_start,
        total_kv_heads=g.model_kv_heads,
    )


def parse_geometry(info: GeometryInfo) -> KVGeometry:
    """The peer rank's geometry; PeerMismatchError if it is not a valid one."""
    dtype = getattr(torch, info.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise PeerMismatchError(f"peer KV dtype {info.dtype!r} is not a torch dtype")
    try:
        return KVGeometry(
            info.num_layers,
            info.num_kv_heads,
            info.head_dim,
            info.page_size,
            dtype,
            info.head_start,
            info.total_kv_heads,
        )
    except KVCacheError as exc:
        raise PeerMismatchError(f"peer KV geometry is not valid: {exc}") from exc


def check_compatible(local: KVGeometry, local_version: str, peer: GeometryInfo, peer_version: str | None) -> None:
    """PeerMismatchError naming every model-level field in which the peer differs (weight version included)."""
    theirs = parse_geometry(peer)
    diffs = [
        f"{name.removeprefix('model_')} {_show(getattr(local, name))} != {_show(getattr(theirs, name))}"
        for name in MODEL_FIELDS
        if getattr(local, name) != getattr(theirs, name)
    ]
    if peer_version is not None and peer_version != local_version:
        diffs.append(f"weight_version {local_version!r} != {peer_version!r}")
    if diffs:
        raise PeerMismatchError("peer KV cache mismatch: " + ", ".join(diffs))


def check_peer(local: RankSession, peer: RankSession) -> None:
    """Handshake check between two ranks' session infos (both from ``/get_transfer_session_ids``)."""
    if local.geometry is None or peer.geometry is None:
        raise PeerMismatchError("peer session has no geometry: not a kvmove server, cannot validate the peer")
    check_compatible(parse_geometry(local.geometry), local.weight_version or "", peer.geometry, peer.weight_version)
    check_own_layout(peer.geometry, peer.host_kv_data_ptrs, peer.host_kv_item_lens)
    check_transport(local.transport, peer.transport)


def check_peers(local: list[RankSession], peer: list[RankSession]) -> None:
    """``check_peer`` for every rank of two workers (their tensor parallelism may differ)."""
    if not local or not peer:
        raise PeerMismatchError("a worker published no ranks in its session info")
    for theirs in peer:
        check_peer(local[0], theirs)


def check_transport(local: str | None, peer: str | None) -> None:
    """Both ranks must move K/V over the same transport (checked where both say which: SGLang peers do not)."""
    if local and peer and local != peer:
        raise PeerMismatchError(
            f"peer transport mismatch: the peer moves KV over {peer!r}, this rank over {local!r} "
            "(start both servers with the same --transport)"
        )


def check_layout(local: RankSession, data_ptrs: list[int], item_lens: list[int]) -> None:
    """The peer's host buffers must be as many and as long per page as ours (a peer rank holding the same heads;
    catches SGLang-only clients too)."""
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


def check_own_layout(geometry: GeometryInfo, data_ptrs: list[int], item_lens: list[int]) -> None:
    """A rank's host buffers as it publishes them must match its own geometry: one K and one V buffer per layer,
    each ``page_bytes`` per page."""
    g = parse_geometry(geometry)
    if len(data_ptrs) != g.num_buffers or len(item_lens) != g.num_buffers:
        raise PeerMismatchError(
            f"peer rank has {len(data_ptrs)} host KV buffers ({len(item_lens)} item lens) for {g.num_layers} layers"
        )
    if any(n != g.page_bytes for n in item_lens):
        raise PeerMismatchError(f"peer host_kv_item_lens {item_lens[:2]}... != {g.page_bytes} bytes per page")


def check_target(local: RankSession, target: TransferTarget) -> None:
    """What a source rank can check of one target entry before anything moves: with the target's geometry (kvmove
    clients send it), the same model and a self-consistent layout; without it (SGLang clients), the fork's own
    assumption, a rank laid out exactly as this one."""
    check_transport(local.transport, target.transport)
    if target.geometry is None or local.geometry is None:
        check_layout(local, target.host_kv_data_ptrs, target.host_kv_item_lens)
        return
    check_compatible(parse_geometry(local.geometry), "", target.geometry, None)
    check_own_layout(target.geometry, target.host_kv_data_ptrs, target.host_kv_item_lens)


def target_for_rank(targets: list[TransferTarget], tp: int, pp: int) -> TransferTarget:
    found = [t for t in targets if (t.tp, t.pp) == (tp, pp)]
    if len(found) != 1:
        raise PeerMismatchError(f"no single target entry for rank tp={tp} pp={pp} ({len(found)} given)")
    return found[0]


def _show(value: object) -> str:
    return str(value).removeprefix("torch.")
