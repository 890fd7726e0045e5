"""Both launchers run the same rank hosts: the same config gives the same rows (timings aside); the processes
launcher (no Ray: the GPU machine's) runs every transport it can and syncs with and without direct pulls."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from kvmove.bench.results import COLUMNS, append_rows, load_results
from kvmove.bench.syncs import sync_row
from kvmove.models import model_totals, resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Placement, SyncConfig, SyncOptions
from kvmove.sync.driver.run import run_syncs
from kvmove.sync.strategies import parse_strategies
from kvmove.transport import available_transports

TIMINGS = {"timestamp", "seconds", "gbps", "link_limit_gbps", "peak_memory_bytes"}
"""Row columns that measure time (or carry the run's labels): they differ between any two runs. Peak memory
counts the staging held at once, which depends on how the pulls of concurrent threads interleave."""
EXTRA_TIMINGS = {
    "transfer_gbps", "fraction_of_link", "rss_bytes", "launcher", "peak_extra_bytes", "cpu_seconds", "cpu_busy_cores",
    "broadcast_calls",
}  # fmt: skip


def _config(launcher: str, **kw: object) -> SyncConfig:
    base: dict[str, object] = dict(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout.parse("tp=2,ep=2"),
        engine=EngineLayout.parse("tp=2"),
        strategies=tuple(parse_strategies("v1,v2,v3,broadcast")),
        transport="nixl" if "nixl" in available_transports() else "gloo",
        verify=True,
        placement=Placement(launcher=launcher),
        deadline_s=60.0,
    )
    base.update(kw)
    return SyncConfig(**base)  # type: ignore[arg-type]


def _recorded(config: SyncConfig, tmp: Path) -> list[dict[str, object]]:
    """Rows of a run as written to and read back from results/ (what `kvmove sync-weights` records)."""
    results = list(run_syncs(config))
    assert [r.strategy for r in results] == ["v1", "v2", "v3", "broadcast"]
    assert all(r.verified and r.live_engines == config.engine.world for r in results), results
    append_rows(tmp, "sync", [sync_row(config, r) for r in results])
    return load_results(tmp).to_dict("records")


def _comparable(row: dict[str, object]) -> dict[str, object]:
    import json

    extra = {k: v for k, v in json.loads(str(row["extra"])).items() if k not in EXTRA_TIMINGS}
    phases = sorted(json.loads(str(row["phases"])))
    return {k: v for k, v in row.items() if k not in TIMINGS | {"extra", "phases"}} | {"extra": extra, "phases": phases}


@pytest.mark.usefixtures("ray_session")
def test_both_launchers_sync_every_strategy_with_the_same_rows(tmp_path: Path) -> None:
    ray_rows = _recorded(_config("ray"), tmp_path / "ray")
    proc_rows = _recorded(_config("processes"), tmp_path / "processes")
    for rows, launcher in ((ray_rows, "ray"), (proc_rows, "processes")):
        for row in rows:
            assert set(row) == set(COLUMNS)
            empty = [c for c, v in row.items() if v is None or v == "" or (isinstance(v, float) and math.isnan(v))]
            assert not empty, f"{launcher}: columns left empty: {empty}"
            assert float(row["seconds"]) > 0 and float(row["link_limit_gbps"]) > 0 and int(row["bytes"]) > 0
            assert f'"launcher": "{launcher}"' in str(row["extra"])
            _spent_and_sent(row)
    assert [_comparable(r) for r in ray_rows] == [_comparable(r) for r in proc_rows]


def _spent_and_sent(row: dict[str, object]) -> None:
    """Every rank process reports its CPU seconds, and the broadcast's root one timed send per tensor."""
    import json

    extra = json.loads(str(row["extra"]))
    cpu = extra["cpu_seconds"]
    assert cpu["trainer"] >= cpu["trainer_busiest"] > 0 and cpu["engine"] >= cpu["engine_busiest"] > 0, cpu
    assert extra["cpu_busy_cores"] > 0
    if row["strategy"] == "broadcast":
        sends = extra["broadcast_calls"]
        assert sends["calls"] == model_totals(resolve_model("qwen3-moe-tiny")).num_tensors
        assert sends["bytes"] == int(row["bytes"]) // 2 and 0 < sends["seconds"] < float(row["seconds"])
    else:
        assert "broadcast_calls" not in extra


@pytest.mark.parametrize(("transport", "trainer"), [("gloo", "tp=2,ep=2"), ("nccl", "tp=1")])
def test_processes_launcher_syncs_without_ray(transport: str, trainer: str) -> None:
    # nccl runs its pull protocol over gloo on CPU (the CPU twin of the GPU transport)
    config = _config("processes", transport=transport, trainer=TrainerLayout.parse(trainer))
    results = list(run_syncs(config))
    assert [r.strategy for r in results] == ["v1", "v2", "v3", "broadcast"]
    assert all(r.verified and r.transport.startswith(("gloo", "nccl")) for r in results)
    assert len({r.bytes for r in results[:3]}) == 1 and results[3].bytes == 2 * 2 * 256_192


@pytest.mark.parametrize("direct", [True, False])
def test_syncs_verify_with_and_without_direct_pulls(direct: bool) -> None:
    config = _config(
        "processes",
        strategies=tuple(parse_strategies("v2,v3")),
        syncs=2,
        options=SyncOptions(direct=direct),
    )
    results = list(run_syncs(config))
    assert all(r.verified for r in results) and len(results) == 4
    assert len({r.bytes for r in results}) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["nccl", "cuda-ipc"])
@pytest.mark.parametrize("direct", [True, False])
def test_gpu_syncs_repeat_without_hanging(transport: str, direct: bool) -> None:
    """Regression: the nccl pull transport used to hang at the second sync (a receive posted on the GPU while
    waiting for the next request blocked the trainer's next device-synchronizing call)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    config = _config(
        "processes",
        trainer=TrainerLayout.parse("tp=1"),  # NOTE: NCCL refuses two ranks of one communicator on one GPU
        engine=EngineLayout.parse("tp=1"),
        strategies=tuple(parse_strategies("v2,v3")),
        transport=transport,
        syncs=3,
        options=SyncOptions(direct=direct),
    )
    config = replace(config, placement=Placement("processes", ("cuda:0",), ("cuda:1",)))
    results = list(run_syncs(config))
    assert len(results) == 6 and all(r.verified for r in results)


@pytest.mark.parametrize("launcher", ["processes", "ray"])
def test_colocated_placement_syncs_verified_with_reads_on_and_off_the_device(
    launcher: str, request: pytest.FixtureRequest
) -> None:
    # the CPU twin of trainer and engine ranks sharing GPUs: engine rank i reads trainer rank i's arena in place
    if launcher == "ray":
        request.getfixturevalue("ray_session")
    config = _config(
        launcher,
        trainer=TrainerLayout.parse("tp=2,ep=2"),
        engine=EngineLayout.parse("tp=1", 2),
        strategies=tuple(parse_strategies("v2,v3")),
        placement=Placement(launcher=launcher, colocated=True),
    )
    results = list(run_syncs(config))
    assert [r.strategy for r in results] == ["v2", "v3"] and all(r.verified for r in results), results
    for r in results:
        assert r.link_bytes["local_bytes"] > 0 and r.link_bytes["cross_bytes"] > 0
        assert r.link_bytes["local_bytes"] + r.link_bytes["cross_bytes"] == r.bytes
    row = sync_row(config, results[-1])
    assert row.extra["placement"] == "colocated" and row.extra["engine_devices"] == ["cpu"]


_LOCK_HOLDING_RANK = '''
import multiprocessing as mp
from kvmove.sync.launchers.processes import serve_rank

class LockHolder:
    """A rank whose libraries made a tracked semaphore (as tqdm does in save_pretrained) and never freed it."""

    address = ("127.0.0.1", 0)

    def __init__(self, spec):
        self.lock = mp.get_context("spawn").RLock()

    def close(self):
        pass

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    rank = ctx.Process(target=serve_rank, args=(LockHolder, None, child))
    rank.start()
    assert parent.recv() == ("127.0.0.1", 0)
    parent.send("stop")
    rank.join(60)
    print(rank.exitcode)
'''


def test_a_rank_process_unlinks_what_it_registered_with_the_resource_tracker(tmp_path: Path) -> None:
    # a rank ends with os._exit (its transport threads may be blocked on peers that are gone), which skips the
    # finalizers that unlink semaphores and shared memory: the resource tracker would warn of leaks at exit
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(_LOCK_HOLDING_RANK)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]
