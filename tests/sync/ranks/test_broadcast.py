"""The broadcast baseline's group, kept from sync to sync (kvmove.sync.ranks.broadcast.KeptGroup)."""

from __future__ import annotations

import threading

import torch

from kvmove.ports import free_port
from kvmove.sync.ranks.broadcast import KeptGroup
from kvmove.sync.ranks.control import Address, BroadcastGroup


def _group(prefix: str) -> BroadcastGroup:
    return BroadcastGroup(Address("127.0.0.1", free_port()), 2, prefix)


def test_a_kept_group_is_opened_once_per_named_group_and_broadcasts_over_it_every_time() -> None:
    """Two members (threads) broadcast three times over one named group, then over a new one: each member opens
    each group once, and every broadcast arrives."""
    first, second = _group("bcast-1"), _group("bcast-4")
    opened: dict[int, list[object]] = {0: [], 1: []}
    got: dict[int, list[int]] = {0: [], 1: []}

    def member(m: int) -> None:
        kept = KeptGroup()
        for n, group in enumerate((first, first, first, second, second)):
            pg = kept.get(group, m, "cpu", 60.0)
            if not opened[m] or opened[m][-1] is not pg:
                opened[m].append(pg)
            t = torch.full((4,), n if m == 0 else -1, dtype=torch.int32)
            pg.broadcast(t.view(torch.uint8), 0).wait()
            got[m].append(int(t[0]))

    threads = [threading.Thread(target=member, args=(m,)) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4]}
    assert [len(v) for v in opened.values()] == [2, 2]  # the first group, then the second: nothing reopened


def test_member_0_hosts_the_groups_store_before_any_member_connects() -> None:
    """The driver asks trainer rank 0 to host the store first (``HostBroadcastStore``): the store listens before
    the group is named, a member can reach it at once, and member 0's group is opened over that very store (a
    second store bound at the same address would fail), once; a store hosted and never named is dropped."""
    import torch.distributed as dist

    kept = KeptGroup()
    never_named = kept.host("127.0.0.1", 60.0)
    address = kept.host("127.0.0.1", 60.0)
    assert address.port > 0 and address != never_named and kept._hosted is not None and kept._hosted[0] == address
    client = dist.TCPStore(address.host, address.port, None, False, wait_for_workers=False)
    client.set("ping", "1")  # listening already: nobody has opened the group yet
    group = BroadcastGroup(address, 2, "bcast-hosted")
    got: list[int] = []

    def member_1() -> None:
        pg = KeptGroup().get(group, 1, "cpu", 60.0)
        t = torch.zeros(4, dtype=torch.int32)
        pg.broadcast(t.view(torch.uint8), 0).wait()
        got.append(int(t[0]))

    thread = threading.Thread(target=member_1)
    thread.start()
    pg = kept.get(group, 0, "cpu", 60.0)
    assert kept._opened is not None and kept._opened.store.get("ping") == b"1"  # the hosted store, not a new one
    assert kept._hosted is None and kept.get(group, 0, "cpu", 60.0) is pg
    pg.broadcast(torch.full((4,), 7, dtype=torch.int32).view(torch.uint8), 0).wait()
    thread.join(timeout=120)
    assert got == [7]
