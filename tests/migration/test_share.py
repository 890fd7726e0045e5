"""No single caller can hold the pools: one migration holds at most its share of the host (and device) pool, the
pending migrations of one client address at most theirs, and generation keeps running beside a maximal one."""

from __future__ import annotations

import pytest

from kvmove.migration.errors import ShareExceededError
from kvmove.migration.share import PoolShare


@pytest.mark.parametrize(
    ("pages", "held", "ok"),
    [(24, 0, True), (25, 0, False), (10, 14, True), (10, 15, False), (0, 24, True)],
)
def test_share_arithmetic(pages: int, held: int, ok: bool) -> None:
    share = PoolShare(migration=0.5, peer=0.5)
    if ok:
        share.check(pages, held, 48, "10.0.0.1", "host pool")
    else:
        with pytest.raises(ShareExceededError) as err:
            share.check(pages, held, 48, "10.0.0.1", "host pool")
        assert err.value.status == 429


def test_one_client_cannot_hold_the_pools_and_generation_runs_on(start_server) -> None:
    httpx = pytest.importorskip("httpx")
    from kvmove.migration import messages as m
    from kvmove.migration.client import WorkerClient
    from kvmove.migration.errors import MigrationError

    s = start_server(migration_share=0.5, peer_share=0.75)  # 48 pages of 4 tokens: 24 a migration, 36 a peer
    dst = WorkerClient(s.url)
    ids = list(range(1, 193))  # 48 pages
    with pytest.raises(MigrationError, match="at most 24 pages") as err:
        dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids, extra_token_size=25 * 4))
    assert err.value.status == 429 and not s.runtime.target.pending
    first = dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids[:96], extra_token_size=96))
    with pytest.raises(MigrationError, match="exceed its share of 36") as err:
        dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids[96:], extra_token_size=96))
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 40, "temperature": 0}}
    r = httpx.post(f"{s.url}/generate", json=body, timeout=60)  # half the device pool is still there
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 40
    dst.abort(first.migration_id)
    second = dst.allocate(m.AllocateTokenForTransferReq(input_ids=ids[96:], extra_token_size=96))
    dst.abort(second.migration_id)
    s.runtime.check_integrity()
    s.stop()
