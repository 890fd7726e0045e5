"""The data plane gives nothing away and caches nothing corrupt, checked against a real third NIXL agent:

- what a transfer's target may read is registered for that transfer only: reads outside it are refused, and a
  late READ (after the transfer ended) fails or finds scrubbed zeros, never K/V;
- a stray WRITE into the target's pages between pull and commit is caught at commit (checksum), and so is any
  corruption of a pull; nothing of such a migration becomes cached K/V;
- session infos carry opaque handles, never process addresses; NIXL listens only where the server does.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import torch

from kvmove.migration import messages as m
from kvmove.migration import source as source_module
from kvmove.migration.client import WorkerClient
from kvmove.migration.controller import transfer_body
from kvmove.migration.endpoint import HANDLE_STRIDE
from kvmove.migration.errors import MigrationConflictError
from kvmove.models import resolve_model
from kvmove.models.weights import seeded_checkpoint
from kvmove.reference import Request, RolloutWorker, SamplingParams, WorkerConfig
from kvmove.server.messages import GenerateReq, SamplingParamsMsg
from kvmove.transport import BufferDesc, EndpointInfo, NixlTransport, TransportError


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(ids: list[int], n: int) -> list[int]:
    cfg = resolve_model("qwen3-tiny")
    w = RolloutWorker(cfg, seeded_checkpoint(cfg, 1).items(), WorkerConfig(num_pages=64, page_size=4))
    w.submit(Request("ref", ids, SamplingParams(max_new_tokens=n)))
    return w.run_until_idle()[0].output_ids


def _cache(c: WorkerClient, ids: list[int], key: str) -> None:
    c.generate(GenerateReq(input_ids=ids, sampling_params=SamplingParamsMsg(max_new_tokens=1), extra_key=key))


class _Pulls:
    """Records the pull requests a source sends (what a target, or an eavesdropper, would hold)."""

    def __init__(self, server, monkeypatch) -> None:
        self.sent: list[m.PullKVReq] = []
        real = server.runtime.source.send_pull

        def record(session_id: str, body: m.PullKVReq) -> m.PullKVResp:
            self.sent.append(body)
            return real(session_id, body)

        monkeypatch.setattr(server.runtime.source, "send_pull", record)


def _allocate_and_transfer(src: WorkerClient, dst: WorkerClient, ids: list[int], key: str) -> str:
    size = dst.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=ids, extra_key=key))
    alloc = dst.allocate(
        m.AllocateTokenForTransferReq(input_ids=ids, extra_key=key, extra_token_size=size.extra_token_size)
    )
    src.transfer(transfer_body(ids, key, size, dst.session_ids(), alloc))
    return alloc.migration_id


def _nothing_cached(dst: WorkerClient, ids: list[int], key: str) -> None:
    after = dst.extra_token_size(m.GetRequestExtraTokenSizeReq(input_ids=ids, extra_key=key))
    assert after.matched_token_size == 0, "a refused migration left K/V in the cache"


def _clean(*servers) -> None:
    for s in servers:
        s.runtime.check_integrity()
        assert not s.runtime.target.pending and s.runtime.endpoint.pool.used_pages == 0
        assert s.runtime.endpoint.outbox.used_pages == 0 and s.runtime.endpoint.open_grants == 0


@pytest.fixture
def third_agent():
    """A NIXL agent of nobody's: it holds what it intercepted and tries to use it."""
    agent = NixlTransport()
    yield agent
    agent.close()


def _read_as(agent: NixlTransport, pull: m.PullKVReq, buffer: int, pages: list[int], page_bytes: int) -> torch.Tensor:
    """``agent`` READs ``pages`` of the source's ``buffer`` with what ``pull`` told the target."""
    src = pull.sources[0].endpoint
    agent.connect(EndpointInfo("nixl", src.endpoint, base64.b64decode(src.endpoint_info)))
    local = torch.zeros(len(pages) * page_bytes, dtype=torch.uint8)
    desc = agent.register(local)
    b = src.buffers[buffer]
    remote = BufferDesc("nixl", b.endpoint, b.buffer_id, b.nbytes, b.address)
    ranges = [(p * page_bytes, i * page_bytes, page_bytes) for i, p in enumerate(pages)]
    agent.read(remote, desc, ranges)
    return local


def test_a_late_read_or_one_outside_the_grant_gets_no_kv(pair_over, third_agent, monkeypatch) -> None:
    a, b = pair_over("nixl")
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    pulls = _Pulls(a, monkeypatch)
    ids, key = _ids(16, 31), "late-read"
    _cache(src, ids, key)
    mid = _allocate_and_transfer(src, dst, ids, key)
    dst.commit(mid)
    (pull,) = pulls.sent
    page_bytes = a.runtime.endpoint.outbox.item_lens()[0]
    sent = [int(p) for p in pull.sources[0].src_pages]
    try:
        late = _read_as(third_agent, pull, 0, sent, page_bytes)
    except TransportError:
        pass  # where UCX enforces registrations, the deregistered pages cannot be read at all
    else:
        assert not late.any(), "a late READ found K/V: the staged pages were not scrubbed"
    others = [p for p in range(a.runtime.endpoint.outbox.num_pages) if p not in sent][:2]
    with pytest.raises(TransportError, match="refused"):
        _read_as(third_agent, pull, 0, others, page_bytes)  # never granted: NIXL refuses
    assert a.runtime.endpoint.open_grants == 0
    _clean(a, b)


def _nixl_write(agent: NixlTransport, peer: EndpointInfo, address: int, data: torch.Tensor) -> None:
    """A one-sided WRITE of ``data`` to ``address`` of ``peer`` (raw NIXL: kvmove's transports never write)."""
    agent.connect(peer)
    agent.register(data)
    raw = agent._agent
    local = raw.get_xfer_descs(np.array([[data.data_ptr(), data.numel(), 0]], dtype=np.uint64), "DRAM")
    remote = raw.get_xfer_descs(np.array([[address, data.numel(), 0]], dtype=np.uint64), "DRAM")
    handle = raw.initialize_xfer("WRITE", local, remote, agent._remote_agents[peer.endpoint])
    state = raw.transfer(handle)
    deadline = time.monotonic() + 30
    while state == "PROC" and time.monotonic() < deadline:
        state = raw.check_xfer_state(handle)
    raw.release_xfer_handle(handle)
    assert state == "DONE", state


def test_a_stray_write_between_pull_and_commit_is_caught_at_commit(pair_over, third_agent) -> None:
    a, b = pair_over("nixl")
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    ids, key = _ids(16, 32), "stray-write"
    _cache(src, ids, key)
    mid = _allocate_and_transfer(src, dst, ids, key)
    mig = b.runtime.target.pending[mid]
    assert mig.filled and mig.checksum
    target = b.runtime.endpoint  # NOTE: the attacker holds the target's agent metadata (the old hole)
    page = int(mig.host_pages[0][0])
    address = target.pool.buffers()[0].data_ptr() + page * target.pool.item_lens()[0]
    _nixl_write(third_agent, target.transport.endpoint_info(), address, torch.full((64,), 7, dtype=torch.uint8))
    with pytest.raises(MigrationConflictError, match="changed between pull and commit") as err:
        dst.commit(mid)
    assert err.value.status == 409
    _nothing_cached(dst, ids, key)
    greedy = SamplingParamsMsg(max_new_tokens=6, temperature=0)
    out = dst.generate(GenerateReq(input_ids=ids, sampling_params=greedy, extra_key=key))
    assert out.output_ids == _greedy(ids, 6), "the target computes the prefix itself, uncorrupted"
    _clean(a, b)


def test_corruption_is_caught_over_http_too(pair_over) -> None:
    a, b = pair_over("http")
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    ids, key = _ids(16, 33), "http-corrupt"
    _cache(src, ids, key)
    mid = _allocate_and_transfer(src, dst, ids, key)
    mig = b.runtime.target.pending[mid]
    b.runtime.endpoint.pool.buffers()[3][mig.host_pages[0][-1]] = 42.0  # anything that changes a pulled page
    with pytest.raises(MigrationConflictError):
        dst.commit(mid)
    _nothing_cached(dst, ids, key)
    _clean(a, b)


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_corruption_on_one_rank_of_a_tensor_parallel_migration_is_caught(
    pair_over, tp_pair_over, src_tp: int, dst_tp: int
) -> None:
    """Pulls with two sources (tp=2 -> tp=1) or two target ranks (tp=1 -> tp=2): one checksum covers every rank's
    heads, and a page changed on the last rank alone fails the commit."""
    one, two = pair_over("http"), tp_pair_over("http")
    a, b = (two[0] if src_tp == 2 else one[0]), (two[1] if dst_tp == 2 else one[1])
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    ids, key = _ids(16, 35), f"tp-corrupt-{src_tp}-{dst_tp}"
    _cache(src, ids, key)
    mid = _allocate_and_transfer(src, dst, ids, key)
    mig, last = b.runtime.target.pending[mid], dst_tp - 1
    assert mig.filled == set(range(dst_tp)) and mig.checksum
    b.runtime.plane.endpoints[last].pool.buffers()[0][mig.host_pages[last][0]] = 42.0
    with pytest.raises(MigrationConflictError, match="differ from what the source staged"):
        dst.commit(mid)
    _nothing_cached(dst, ids, key)
    for s in (a, b):
        s.runtime.check_integrity()
        assert not s.runtime.target.pending and s.runtime.plane.open_grants == 0
        assert all(e.pool.used_pages == 0 and e.outbox.used_pages == 0 for e in s.runtime.plane.endpoints)


def test_pages_that_do_not_match_the_source_checksum_are_never_cached(pair, monkeypatch) -> None:
    a, b = pair
    src, dst = WorkerClient(a.url), WorkerClient(b.url)
    ids, key = _ids(16, 34), f"bad-pull-{a.config.transport}"
    _cache(src, ids, key)
    monkeypatch.setattr(source_module, "pages_digest", lambda parts: "0" * 32)  # what arrives differs from it
    mid = _allocate_and_transfer(src, dst, ids, key)
    with pytest.raises(MigrationConflictError, match="differ from what the source staged"):
        dst.commit(mid)
    _nothing_cached(dst, ids, key)
    _clean(a, b)


def test_session_infos_carry_no_process_addresses(pair) -> None:
    a, _ = pair
    (rank,) = WorkerClient(a.url).session_ids().ranks
    assert rank.host_kv_data_ptrs == [i * HANDLE_STRIDE for i in range(8)]
    real = {buf.data_ptr() for buf in a.runtime.endpoint.pool.buffers() + a.runtime.endpoint.outbox.buffers()}
    assert not real & set(rank.host_kv_data_ptrs)


def _listening(pid: int) -> list[str]:
    """Local addresses of the TCP sockets process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address = fields[1].split(":")[0]
                found.append(_ip(address, width))
    return found


def _ip(hex_address: str, width: int) -> str:
    raw = bytes.fromhex(hex_address)
    if width == 8:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    return ":".join(b"".join(words)[i : i + 2].hex() for i in range(0, 16, 2))


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux /proc")
def test_nixl_listens_only_on_the_interface_the_server_serves_on(tmp_path) -> None:
    if not NixlTransport.is_available():
        pytest.skip("NIXL is not installed")
    from kvmove.ports import free_port
    from kvmove.server.config import ServerConfig
    from kvmove.server.launch import LocalCluster

    config = ServerConfig(port=free_port(), enable_kv_migration=True, transport="nixl", num_pages=16, page_size=4)
    with LocalCluster([config], tmp_path) as cluster:
        addresses = _listening(cluster.procs[0].pid)
    assert len(addresses) >= 2, addresses  # uvicorn's and UCX's listeners
    assert set(addresses) == {"127.0.0.1"}, f"a listener on another interface: {addresses}"
