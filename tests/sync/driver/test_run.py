"""Real syncs on the default launcher (Ray actors on loopback): every strategy verified bit-exact, faults survived."""

from __future__ import annotations

import pytest

from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Fault, SyncConfig
from kvmove.sync.driver.run import run_syncs
from kvmove.sync.strategies import parse_strategies

pytestmark = pytest.mark.usefixtures("ray_session")


def _config(**kw) -> SyncConfig:
    base = dict(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse("tp=2,pp=2,ep=2"),
        engine=EngineLayout.parse("tp=2,ep=2", 2),
        strategies=tuple(parse_strategies("v1,v2,v3,broadcast")),
        transport="object-store",
        syncs=1,
        verify=True,
        deadline_s=60.0,
    )
    base.update(kw)
    return SyncConfig(**base)


def test_every_strategy_moves_exact_bytes_and_verifies() -> None:
    results = list(run_syncs(_config(syncs=2)))
    assert [(r.strategy, r.sync) for r in results] == [(s, i) for s in ("v1", "v2", "v3", "broadcast") for i in (1, 2)]
    for r in results:
        assert r.verified is True and r.live_engines == 4, r
    pulled = {r.bytes for r in results if r.strategy != "broadcast"}
    assert len(pulled) == 1  # every pull strategy moves exactly the planned bytes
    (broadcast,) = {r.bytes for r in results if r.strategy == "broadcast"}
    assert broadcast == 4 * 2 * 256_192  # the whole BF16 model to every engine rank
    v3 = next(r for r in results if r.strategy == "v3")
    bc = next(r for r in results if r.strategy == "broadcast")
    assert v3.peak_extra_bytes["engine"] < bc.peak_extra_bytes["engine"] == 2 * 256_192


def test_dead_replica_is_skipped_then_rejoins_verified() -> None:
    results = list(run_syncs(_config(strategies=tuple(parse_strategies("v3")), syncs=3, faults=(Fault(1, 2),))))
    first, killed, back = results
    assert first.live_engines == 4 and first.verified
    assert killed.live_engines == 2 and killed.dead_replicas == (1,) and killed.verified
    assert back.live_engines == 4 and back.rejoined_replicas == (1,) and back.verified


def test_engine_dying_mid_sync_on_the_demo_model_lands_mid_sync_and_never_hangs() -> None:
    """A demo-model sync takes a few hundredths of a second: the fault counts pulls, not time."""
    config = _config(
        trainer=TrainerLayout.parse("tp=2,ep=2"),
        engine=EngineLayout.parse("tp=2", 2),
        strategies=tuple(parse_strategies("v2")),
        syncs=2,
        faults=(Fault(0, 1, during=True),),
    )
    mid, after = run_syncs(config)
    assert mid.seconds < config.deadline_s  # nobody waited for the dead replica until a deadline
    assert mid.dead_replicas == (0,) and mid.live_engines == 2 and mid.verified
    ((rank, finished),) = mid.pulls_before_kill.items()
    assert rank == 0 and finished > 0
    note = next(n for n in mid.notes if "during sync 1" in n)
    total = int(note.split(" of ")[1].split()[0])
    assert finished < total, note  # killed with pulls still to go: mid-sync
    assert after.live_engines == 4 and after.rejoined_replicas == (0,) and after.verified


def test_slow_replica_does_not_delay_the_others() -> None:
    config = _config(strategies=tuple(parse_strategies("v2")), slow_replicas=((1, 1.5),))
    (r,) = run_syncs(config)
    assert r.verified and r.replica_seconds[1] > 1.5
    assert r.replica_seconds[0] < r.replica_seconds[1] - 1.0


def test_bad_fault_spec() -> None:
    with pytest.raises(KvmoveError, match="REPLICA@SYNC"):
        Fault.parse("one@two")
    with pytest.raises(KvmoveError, match="SYNC from 1"):
        Fault.parse("1@0")
    assert Fault.parse("1@3:mid") == Fault(1, 3, True)


def test_bad_input_is_refused_before_any_actor_starts(monkeypatch) -> None:
    from kvmove.errors import MissingDependencyError
    from kvmove.sync.launchers.ray import start_ray
    from kvmove.transport import nixl

    with pytest.raises(KvmoveError, match=r"cannot reach a Ray cluster at 127\.0\.0\.1:9"):
        start_ray("127.0.0.1:9")
    big = _config(model=resolve_model("kimi-k2"), verify=False, strategies=tuple(parse_strategies("v3")))
    with pytest.raises(KvmoveError, match=r"needs about .* GB here"):
        list(run_syncs(big))
    monkeypatch.setattr(nixl.NixlTransport, "is_available", classmethod(lambda cls: False))
    with pytest.raises(MissingDependencyError, match=r"pip install 'kvmove\[nixl\]'"):
        list(run_syncs(_config(transport="nixl")))


@pytest.mark.parametrize("transport", ["nixl", "rdt-nixl", "rdt-gloo", "gloo", "object-store"])
def test_each_transport_syncs_bit_exact(transport: str) -> None:
    from kvmove.transport import available_transports

    if transport not in available_transports():
        pytest.skip(f"{transport} is not installed here")
    config = _config(
        trainer=TrainerLayout.parse("tp=2"),
        engine=EngineLayout.parse("tp=1"),
        strategies=tuple(parse_strategies("v2,v3")),
        transport=transport,
    )
    results = list(run_syncs(config))
    assert all(r.verified and r.transport == transport for r in results)
    assert results[0].bytes == results[1].bytes == 2 * 256_192  # one engine rank holding the whole model


def test_two_sided_transports_refuse_fault_injection() -> None:
    with pytest.raises(KvmoveError, match="rejoin"):
        list(run_syncs(_config(transport="gloo", faults=(Fault(0, 1),))))


def test_the_broadcast_group_is_kept_until_a_replica_goes_or_rejoins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broadcast syncs reuse the group their ranks opened (as a framework's weight-update group), and a replica
    lost before sync 2 and restarted for sync 3 gets a group of the ranks then live; every sync verified."""
    from kvmove.sync.driver.running import RunningRanks

    named = []
    original = RunningRanks.broadcast_group

    def spy(self: RunningRanks, live: list[int], sync_id: int) -> object:
        group = original(self, live, sync_id)
        named.append(group)
        return group

    monkeypatch.setattr(RunningRanks, "broadcast_group", spy)
    config = _config(strategies=tuple(parse_strategies("broadcast")), syncs=4, faults=(Fault(1, 2),))
    results = list(run_syncs(config))
    assert [(r.live_engines, r.verified) for r in results] == [(4, True), (2, True), (4, True), (4, True)]
    first, alone, back, again = named
    assert (first.size, alone.size, back.size) == (5, 3, 5)
    assert len({first, alone, back}) == 3 and again is back
