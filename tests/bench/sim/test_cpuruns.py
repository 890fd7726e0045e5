"""kvmove's CPU syncs judged: one model's rows of a run set the cpu target's costs (rates over the run's own
loopback read), another model's rows of the same commit and layout are predicted; CPU and GPU rows never set each
other's costs."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from kvmove.bench.results import Labels, Row, append_rows, load_results
from kvmove.bench.sim.cpuruns import (
    cpu_book,
    cpu_checks,
    cpu_runs,
    cpu_split,
    cpu_splits,
    engine_processes,
    split_scores,
)
from kvmove.bench.sim.hardware import Cluster
from kvmove.bench.sim.measure import costs_from_rows
from kvmove.bench.sim.models import sim_model
from kvmove.bench.sim.predict import simulate
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.errors import KvmoveError
from kvmove.models import model_totals
from kvmove.sync.ranks.calltimes import CallTimes

CPU = "cpu:AMD EPYC x2"
TRAINER, ENGINE = "tp=2,pp=2,ep=2,etp=1,dp=1", "tp=2,dp=1,ep=2,pp=1 x2"


def _sync(
    model: str, strategy: str, seconds: float, phases: dict[str, float], raw: float | None, bcast: float = 0.0
) -> Row:
    nbytes = model_totals(sim_model(model)).total_bytes
    extra: dict[str, object] = {"sync": 2, "verified": True, "direct": True, "transfer_gbps": 0.0, "live_engines": 4}
    if strategy in ("v2", "v3"):
        extra["transfer_gbps"] = nbytes / phases["transfer"] / 1e9
    if raw is not None:
        extra["raw_gbps"] = raw
    if bcast:
        extra |= {"raw_broadcast_gbps": bcast, "raw_broadcast_members": 5}
    return Row(
        kind="measured", suite="sync", name=f"sync {strategy}", model=model, trainer=TRAINER, engine=ENGINE,
        strategy=strategy, transport="gloo-broadcast" if strategy == "broadcast" else "nixl",
        bytes=nbytes * (4 if strategy == "broadcast" else 1), seconds=seconds, phases=phases, extra=extra,
    )  # fmt: skip


def _run(model: str, raw: float | None, scale: float, bcast: float = 0.0) -> list[Row]:
    v1 = {"gather": 2.0 * scale, "request": 2.3 * scale, "pack": 0.1 * scale, "load": 0.1, "transfer": 0.1}
    broadcast = {"gather": 1.0 * scale, "transfer": 1.05 * scale, "load": 0.05, "trainer_wait": 0.6 * scale}
    return [
        _sync(model, "v1", 3.0 * scale, v1, raw, bcast),
        _sync(model, "v2", 0.03 + 0.05 * scale, {"transfer": 0.05 * scale}, raw, bcast),
        _sync(model, "v3", 0.03 + 0.04 * scale, {"transfer": 0.04 * scale}, raw, bcast),
        _sync(model, "broadcast", 1.1 * scale, broadcast, raw, bcast),
    ]


@pytest.fixture
def cpu_rows(tmp_path):
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    return load_results(tmp_path)


def test_the_model_whose_run_measured_its_loopback_sets_the_cpu_costs(cpu_rows) -> None:
    split = cpu_split(cpu_rows)
    assert split is not None and (split.commit, split.train.model) == ("c1", "qwen3-moe-small")
    assert [h.model for h in split.held] == ["qwen3-moe-tiny"]
    assert split.raw_gbps == 3.5
    book = cpu_book(cpu_rows, split)
    for name in ("request_s", "pack_call_s", "collective_s", "pull_efficiency", "sync_s", "broadcast_op_s"):
        cost = book.costs[name]
        assert cost.kind in ("measured", "derived"), name
        assert {r.commit for r in cost.rows} == {"c1"} and all("qwen3-moe-small" in r.setup for r in cost.rows), name
    assert book["sync_s"] == pytest.approx(0.03)  # direct v2/v3: seconds - transfer
    assert 0 < book["pull_efficiency"] <= 1  # over the run's own loopback read
    # rank 0's own time in its broadcast calls (trainer_wait), 3 rounds of gloo's tree to 4 engine ranks, its bytes
    # at the default broadcast rate (no raw gloo broadcast in these rows)
    tensors = model_totals(sim_model("qwen3-moe-small")).num_tensors
    nbytes = model_totals(sim_model("qwen3-moe-small")).total_bytes
    expected = (0.6 - 3 * nbytes / (3.5e9 * 0.8)) / (3 * tensors)
    assert book.costs["nccl_efficiency"].kind == "default"
    assert book["broadcast_op_s"] == pytest.approx(expected)
    assert book.costs["materialize_s"].kind == "derived" and book["materialize_s"] > 0  # the gather onto rank 0


def test_cpu_rows_never_set_a_gpu_targets_cost(cpu_rows) -> None:
    for target in ("cluster", "one-gpu"):
        book = costs_from_rows(cpu_rows, target)
        for name in ("request_s", "collective_s", "pull_efficiency", "sync_s", "broadcast_op_s"):
            assert book.costs[name].kind == "default", (target, name)


def test_the_other_models_rows_are_predicted(cpu_rows) -> None:
    runs = cpu_runs(cpu_rows)
    assert sorted(r.strategy for r in runs) == ["broadcast", "v1", "v2", "v3"]
    assert all(r.target == "cpu" and r.role == "held-out (ours, CPU)" and "qwen3-moe-tiny" in r.key for r in runs)
    assert all(f"qwen3-moe-small {TRAINER} -> {ENGINE} rows of c1" in r.basis for r in runs)
    cluster = Cluster.parse(runs[0].spec.cluster)
    assert cluster.nvlink_rate == 3.5e9 and cluster.hbm_rate == 7e9
    checks = cpu_checks(cpu_rows)
    assert len(checks) == 4 and all(c.predicted > 0 for c in checks)
    v2 = next(c for c in checks if c.run.strategy == "v2")
    assert v2.predicted >= 0.03  # never below the driver's fixed work the training run measured


def test_no_split_without_two_setups_at_a_commit_and_a_measured_loopback(tmp_path) -> None:
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    assert cpu_split(load_results(tmp_path)) is None  # one setup only
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c2"))
    assert cpu_split(load_results(tmp_path)) is None  # two setups, but at two commits
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", None, 1.0), Labels(CPU, {}, "c3"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c3"))
    assert cpu_split(load_results(tmp_path)) is None  # two setups of one commit, no raw read measured
    assert cpu_checks(load_results(tmp_path)) == [] and cpu_split(None) is None


def test_another_layout_of_the_commit_is_predicted_too(tmp_path) -> None:
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    other = [
        r.__class__(**{**r.__dict__, "engine": "tp=1,dp=1,ep=1,pp=1 x1"}) for r in _run("qwen3-moe-small", None, 1)
    ]
    append_rows(tmp_path, "sync", other, Labels(CPU, {}, "c1"))
    runs = cpu_runs(load_results(tmp_path))
    assert len(runs) == 4 and all(r.key.endswith("x1") and r.spec.replicas == 1 for r in runs)


def _replicas(rows: list[Row], engine: str, gather: float) -> list[Row]:
    """``rows`` of another engine label, their v1 gather phase ``gather``."""
    out = []
    for r in rows:
        phases = {**r.phases, "gather": gather} if r.strategy == "v1" else r.phases
        out.append(dataclasses.replace(r, engine=engine, phases=phases))
    return out


def test_held_out_runs_take_the_costs_of_the_training_run_with_as_many_engine_ranks(tmp_path) -> None:
    """The training run's model and layouts at one replica train too (not held out). Each held-out run is priced
    with the costs of the training run whose engine-rank processes are nearest in number (on a host of a few
    cores they take cores from the trainer's ranks): one TP1 engine (1 rank) from the one-replica run (2), the tiny
    model into two TP2 engines (4) from the two-replica run (4); a tie goes to the larger. The partner's rows take
    the training run's raw read, so its rates are measured too."""
    one, tp1 = "tp=2,dp=1,ep=2,pp=1 x1", "tp=1,dp=1,ep=1,pp=1 x1"
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _replicas(_run("qwen3-moe-small", None, 0.6), one, 1.4), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _replicas(_run("qwen3-moe-small", None, 1.0), tp1, 1.2), Labels(CPU, {}, "c1"))
    rows = load_results(tmp_path)
    split = cpu_split(rows)
    assert split is not None and [p.engine for p in split.partners] == [one]
    held = sorted(h.model + " " + h.engine for h in split.held)
    assert held == [f"qwen3-moe-small {tp1}", f"qwen3-moe-tiny {ENGINE}"]
    assert split.training_for(ENGINE) == split.train and split.training_for(tp1).engine == one
    assert split.training_for("tp=1 x3") == split.train  # 3 ranks: as near 4 as 2, the larger wins
    assert engine_processes(ENGINE) == 4 and engine_processes(tp1) == 1
    partner = cpu_book(rows, split, split.partners[0])
    assert partner.costs["pull_efficiency"].kind == "measured"  # at the training run's raw read
    for book, engine in ((cpu_book(rows, split), ENGINE), (partner, one)):
        refs = [r for c in book.costs.values() for r in c.rows]
        assert refs and all(f"-> {engine} " in r.setup for r in refs)
    checks = cpu_checks(rows)
    assert len(checks) == 8
    for c in checks:
        engine = ENGINE if "tiny" in c.run.key else one
        assert c.book is not None and all(f"-> {engine} " in r.setup for r in c.book.costs["collective_s"].rows)
        assert f"-> {engine} rows of c1" in c.run.basis
        (p,) = simulate(c.run.spec.build(), [SIM_STRATEGIES[c.run.strategy]], c.book)
        assert p.seconds == c.predicted
    small = next(c for c in checks if c.run.strategy == "v1" and "small" in c.run.key)
    (alone,) = simulate(small.run.spec.build(), [SIM_STRATEGIES["v1"]], cpu_book(rows, split))
    assert small.predicted < alone.seconds  # the one-replica run's cheaper gathers, not the two-replica run's


def test_a_second_run_of_the_training_setup_without_its_own_raw_read_trains_at_the_runs_rates(tmp_path) -> None:
    """A recording in ABBA order runs the training setup twice, the second time through ``kvmove sync-weights``
    (no raw read of its own): both runs' rows set the costs, the second at the first run's raw read."""
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    once = load_results(tmp_path)
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", None, 1.0), Labels(CPU, {}, "c1"))
    twice = load_results(tmp_path)
    split = cpu_split(twice)
    assert split is not None and split.raw_gbps == 3.5 and not split.partners
    for name in ("pull_efficiency", "collective_s"):
        one, two = cpu_book(once).costs[name], cpu_book(twice).costs[name]
        assert one.kind == two.kind == "measured" and len(two.rows) == 2 * len(one.rows), name
    assert [c.predicted for c in cpu_checks(twice)] == pytest.approx([c.predicted for c in cpu_checks(once)])


def test_a_commit_with_only_the_training_run_at_two_replica_counts_has_nothing_held_out(tmp_path) -> None:
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    one = _replicas(_run("qwen3-moe-small", None, 1.0), "tp=2,dp=1,ep=2,pp=1 x1", 1.4)
    append_rows(tmp_path, "sync", one, Labels(CPU, {}, "c1"))
    assert cpu_split(load_results(tmp_path)) is None


def test_a_cpu_host_needs_its_own_rates() -> None:
    with pytest.raises(KvmoveError, match="gpu=cpu has no vendor figures"):
        Cluster.parse("gpu=cpu")
    host = Cluster.parse("gpu=cpu,nvlink_gbps=3.5,hbm_gbps=7,pcie_gbps=3.5")
    assert Cluster.parse(host.spec()) == host and "CPU processes" in host.label()


def test_repository_cpu_runs_are_judged(repo_validation) -> None:
    cpu = [o for o in repo_validation.own if o.run.target == "cpu"]
    assert len(cpu) % 4 == 0 and {o.run.strategy for o in cpu} == {"v1", "v2", "v3", "broadcast"}
    book = repo_validation.own_books["cpu"]
    trained = {r.commit for c in book.costs.values() for r in c.rows}
    assert len(trained) == 1 and all(o.run.rows[0].commit in trained for o in cpu)


def test_a_runs_raw_gloo_broadcast_sets_the_cpu_broadcast_rate(tmp_path) -> None:
    """The run's raw broadcast to its 5-member group (trainer rank 0 and 4 engine ranks): its root sends once per
    round of gloo's binomial tree (3 rounds), so the rate its bytes go at is 3 x the broadcast's, over the raw
    read; it sets the cpu target's broadcast rate and nothing of a GPU target."""
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0, bcast=0.3), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    rows = load_results(tmp_path)
    book = cpu_book(rows)
    assert book.costs["nccl_efficiency"].kind == "measured"
    assert book["nccl_efficiency"] == pytest.approx(3 * 0.3 / 3.5)
    assert costs_from_rows(rows, "cluster").costs["nccl_efficiency"].kind == "default"
    slow = {c.run.strategy: c.predicted for c in cpu_checks(rows)}
    append_rows(tmp_path / "fast", "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    append_rows(tmp_path / "fast", "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    fast = {c.run.strategy: c.predicted for c in cpu_checks(load_results(tmp_path / "fast"))}
    # the same measured broadcast with its bytes slower leaves less per call: the small model's prediction drops
    assert slow["broadcast"] < fast["broadcast"] and slow["v2"] == pytest.approx(fast["v2"])


def _with_sends(rows: list[Row], sends: CallTimes) -> list[Row]:
    """``rows`` with the broadcast row's root sends timed one by one (``extra.broadcast_calls``)."""
    return [
        dataclasses.replace(r, extra={**r.extra, "broadcast_calls": sends.as_json()})
        if r.strategy == "broadcast"
        else r
        for r in rows
    ]


def _sends(fixed: float, gbps: float, sizes: list[int]) -> CallTimes:
    sends = CallTimes()
    for nbytes in sizes:
        sends = sends.add(nbytes, fixed + nbytes / (gbps * 1e9))
    return sends


def test_the_line_through_the_roots_sends_splits_its_fixed_cost_from_its_bytes(tmp_path) -> None:
    """A broadcast row that timed its root's sends one by one (sizes from a norm's to an embedding's) sets the
    cpu target's per-step cost from the line's fixed term and the broadcast rate from its per-byte term (3 rounds
    of gloo's tree to 4 engine ranks: the root's bytes go at 3 x the per-send rate), over the raw broadcast the
    same run timed; rows whose sends give no line keep the raw broadcast. The tiny model's sends, tens of bytes to
    kilobytes, are then priced at the fixed term each."""
    sizes = [64, 2048, 300_000, 8 << 20] * 40
    small = _with_sends(_run("qwen3-moe-small", 3.5, 1.0, bcast=0.3), _sends(0.72e-3, 0.476, sizes))
    append_rows(tmp_path, "sync", small, Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    rows = load_results(tmp_path)
    book = cpu_book(rows)
    assert book["broadcast_op_s"] == pytest.approx(0.72e-3 / 3)
    assert book["nccl_efficiency"] == pytest.approx(3 * 0.476 / 3.5)
    assert costs_from_rows(rows, "cluster").costs["nccl_efficiency"].kind == "default"
    (tiny,) = [c for c in cpu_checks(rows) if c.run.strategy == "broadcast"]
    tensors = model_totals(sim_model("qwen3-moe-tiny")).num_tensors
    assert tiny.predicted > tensors * 0.72e-3
    few = _with_sends(_run("qwen3-moe-small", 3.5, 1.0, bcast=0.3), _sends(0.72e-3, 0.476, sizes[:4]))
    append_rows(tmp_path / "few", "sync", few, Labels(CPU, {}, "c1"))
    append_rows(tmp_path / "few", "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    assert cpu_book(load_results(tmp_path / "few"))["nccl_efficiency"] == pytest.approx(3 * 0.3 / 3.5)


def test_a_hosts_cores_bound_how_many_ranks_pull_at_once(tmp_path) -> None:
    """On a 2-core host the training run's 4 engine ranks pulled 2 at a time: the pull rate a rank reaches alone is
    twice the one measured, and a held-out setup with one engine rank is priced at that rate (a 4-rank setup at
    half of it); a GPU takes no cores, and a cluster without them prices each rank alone."""
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    one = [r.__class__(**{**r.__dict__, "engine": "tp=1,dp=1,ep=1,pp=1 x1"}) for r in _run("qwen3-moe-small", None, 1)]
    append_rows(tmp_path, "sync", one, Labels(CPU, {}, "c1"))
    rows = load_results(tmp_path)
    split = cpu_split(rows)
    assert split is not None and split.cores == 2
    nbytes = model_totals(sim_model("qwen3-moe-small")).total_bytes
    measured = nbytes / 0.05 / 1e9  # the v2 rows' per-rank transfer rate
    expected = statistics.median([measured * 4 / 2 / 3.5, nbytes / 0.04 / 1e9 * 4 / 2 / 3.5])
    assert cpu_book(rows, split)["pull_efficiency"] == pytest.approx(min(expected, 1.0))
    (run,) = [r for r in cpu_runs(rows, split) if r.strategy == "v2"]
    host = Cluster.parse(run.spec.cluster)
    assert host.gpu.cores == 2 and "2 cores" in host.label() and Cluster.parse(host.spec()) == host
    four = dataclasses.replace(run.spec, engine="tp=2,dp=1,ep=2,pp=1", replicas=2)
    unbounded = dataclasses.replace(four, cluster=run.spec.cluster.replace(",cores=2", ""))
    book = cpu_book(rows, split)
    (alone,), (shared,), (free,) = (
        simulate(s.build(), [SIM_STRATEGIES["v2"]], book) for s in (run.spec, four, unbounded)
    )
    # 4 ranks of equal bytes on 2 cores: twice the line-rate time of 4 ranks each alone; one rank keeps all bytes
    assert shared.speed_of_light_seconds == pytest.approx(2 * free.speed_of_light_seconds, rel=1e-3)
    assert alone.speed_of_light_seconds == pytest.approx(shared.speed_of_light_seconds, rel=0.05)
    assert shared.phases["transfer"] > free.phases["transfer"] and alone.seconds > free.seconds
    with pytest.raises(KvmoveError, match="cores bounds a CPU host"):
        Cluster.parse("gpu=h200,cores=8")
    with pytest.raises(KvmoveError, match="at least 1"):
        Cluster.parse("gpu=cpu,nvlink_gbps=3.5,hbm_gbps=7,pcie_gbps=3.5,cores=0.5")
    assert Cluster.parse("gpu=cpu,nvlink_gbps=3.5,hbm_gbps=7,pcie_gbps=3.5,cores=1.5").gpu.cores == 1.5


def _raw_reads(single: float, aggregate: float, nbytes: int = 16 << 20) -> list[Row]:
    """The sync suite's raw rows of one run: one reader alone at two sizes, four readers at once at ``nbytes``."""
    return [
        Row(kind="measured", suite="transport", name="raw nixl", transport="nixl", bytes=1 << 20, seconds=1e-4,
            gbps=3.5),
        Row(kind="measured", suite="transport", name="raw nixl", transport="nixl", bytes=nbytes, seconds=1e-3,
            gbps=single),
        Row(kind="measured", suite="transport", name="raw nixl x4 concurrent", transport="nixl", bytes=nbytes,
            seconds=1e-3, gbps=aggregate / 4, extra={"pairs": 4, "aggregate_gbps": aggregate}),
    ]  # fmt: skip


@pytest.mark.parametrize(("single", "aggregate", "cores"), [(2.0, 2.8, 1.4), (2.0, 8.0, 2.0), (2.0, 1.0, 1.0)])
def test_a_hosts_parallel_copies_are_its_measured_concurrent_read(tmp_path, single, aggregate, cores) -> None:
    """Four readers at once moved ``aggregate`` GB/s against ``single`` for one alone (same size, same run): the host
    ran that many line-rate copies at once, between 1 and its cores; a rank alone pulls at the measured per-rank
    rate x 4 ranks / that, and one held-out engine rank is priced on the same host."""
    labels = Labels(CPU, {}, "c1")
    append_rows(tmp_path, "transport", _raw_reads(single, aggregate), labels)
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), labels)
    one = [r.__class__(**{**r.__dict__, "engine": "tp=1,dp=1,ep=1,pp=1 x1"}) for r in _run("qwen3-moe-small", None, 1)]
    append_rows(tmp_path, "sync", one, labels)
    rows = load_results(tmp_path)
    split = cpu_split(rows)
    assert split is not None and split.cores == pytest.approx(cores)
    nbytes = model_totals(sim_model("qwen3-moe-small")).total_bytes
    expected = statistics.median([nbytes / t / 1e9 * 4 / cores / 3.5 for t in (0.05, 0.04)])
    assert cpu_book(rows, split)["pull_efficiency"] == pytest.approx(min(expected, 1.0))
    (run,) = [r for r in cpu_runs(rows, split) if r.strategy == "v2"]
    assert Cluster.parse(run.spec.cluster).gpu.cores == pytest.approx(cores)
    # another commit's raw reads never set this run's host
    append_rows(tmp_path / "other", "transport", _raw_reads(single, aggregate), Labels(CPU, {}, "c0"))
    append_rows(tmp_path / "other", "sync", _run("qwen3-moe-small", 3.5, 1.0), labels)
    append_rows(tmp_path / "other", "sync", one, labels)
    assert cpu_split(load_results(tmp_path / "other")).cores == 2


def test_every_recorded_split_is_scored_oldest_first(tmp_path) -> None:
    """Two commits each recorded a split: both are judged with today's model, each from its own training run's
    costs, and the newest's score is the one the validation table shows."""
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 2.0, 2.0), Labels(CPU, {}, "c2"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.9), Labels(CPU, {}, "c2"))
    rows = load_results(tmp_path)
    splits = cpu_splits(rows)
    assert [s.commit for s in splits] == ["c1", "c2"] and [s.raw_gbps for s in splits] == [3.5, 2.0]
    assert cpu_split(rows) == splits[-1]
    scores = split_scores(rows)
    assert [s.commit for s in scores] == ["c1", "c2"] and all(s.runs == 4 for s in scores)
    for split, score in zip(splits, scores, strict=True):
        errors = [c.error_pct for c in cpu_checks(rows, split=split)]
        assert score.median_abs_error_pct == pytest.approx(statistics.median(abs(e) for e in errors))
        assert score.worst_error_pct == max(errors, key=abs) and score.within_25 == sum(abs(e) <= 25 for e in errors)
    newest = [c.error_pct for c in cpu_checks(rows)]
    assert scores[-1].worst_error_pct == max(newest, key=abs)
    assert scores[0] != scores[1]  # each split priced from its own run, not the newest's
    assert split_scores(None) == []


def test_validate_json_has_a_line_per_recorded_split(monkeypatch, tmp_path) -> None:
    from typer.testing import CliRunner

    import kvmove.bench.sim.validation as sim_validation
    from kvmove.bench.sim.figures import FIGURES
    from kvmove.cli.main import app

    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    few = tuple(f for f in FIGURES if f.key in ("vllm-qwen3-v2", "vllm-qwen3-v3"))
    validate_all = sim_validation.validate_all
    monkeypatch.setattr(sim_validation, "validate_all", lambda book, rows: validate_all(book, rows, few))
    out = CliRunner().invoke(app, ["bench", "simulate", "--validate", "--json", "--results", str(tmp_path)])
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
    (split,) = [x for x in lines if x["kind"] == "cpu-split"]
    assert split["commit"] == "c1" and split["runs"] == 4 and 0 <= split["within_25"] <= 4
    table = CliRunner().invoke(app, ["bench", "simulate", "--validate", "--results", str(tmp_path)])
    assert "our held-out CPU runs on every recorded split" in table.stdout and "c1 (" in table.stdout


def test_a_setup_run_twice_shows_how_far_its_passes_differ(tmp_path) -> None:
    """A recording in ABBA order runs each setup twice: each held-out run keeps both passes' medians, and the
    validation records carry their spread next to the error (None where a setup ran once)."""
    append_rows(tmp_path, "sync", _run("qwen3-moe-small", 3.5, 1.0), Labels(CPU, {}, "c1"))
    append_rows(tmp_path, "sync", _run("qwen3-moe-tiny", None, 0.3), Labels(CPU, {}, "c1"))
    once = {r.strategy: r for r in cpu_runs(load_results(tmp_path))}
    assert all(r.passes == (r.measured,) and r.pass_spread_pct is None for r in once.values())
    second = [
        dataclasses.replace(r, extra={**r.extra, "sync": n}) for n in (2, 3) for r in _run("qwen3-moe-tiny", None, 0.4)
    ]
    append_rows(tmp_path, "sync", second, Labels(CPU, {}, "c1"))
    twice = {r.strategy: r for r in cpu_runs(load_results(tmp_path))}
    v1 = twice["v1"]
    assert v1.passes == pytest.approx((0.9, 1.2))  # the first pass's one sync, then the second's two (sync 2, 3)
    assert v1.measured == pytest.approx(1.2) and v1.pass_spread_pct == pytest.approx(100 * 0.3 / 1.2)

    from kvmove.bench.sim.tables import validation_records
    from kvmove.bench.sim.validation import Validation

    checks = cpu_checks(load_results(tmp_path))
    judged = Validation([], None, checks, {}, [])
    spreads = {r["strategy"]: r["pass_spread_pct"] for r in validation_records(judged)}
    assert spreads == {s: pytest.approx(twice[s].pass_spread_pct) for s in twice}
