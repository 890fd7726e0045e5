from __future__ import annotations

import subprocess
import sys

import pytest

from kvmove.errors import LayoutError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout, compact_label, split_label, split_layers


def test_parse_and_world() -> None:
    t = TrainerLayout.parse("tp=4,pp=2,ep=8,dp=2")
    assert (t.tp, t.pp, t.ep, t.etp, t.dp, t.world, t.edp) == (4, 2, 8, 1, 2, 16, 1)
    e = EngineLayout.parse("dp=16,ep=16", replicas=2)
    assert (e.ranks_per_replica, e.world) == (16, 32)


def test_dp_defaults_to_the_smallest_that_experts_tile() -> None:
    assert TrainerLayout.parse("tp=4,pp=2,ep=8").dp == 2  # the published Qwen3-235B trainer: 16 GPUs
    assert TrainerLayout.parse("tp=8,pp=8,ep=32").world == 256  # the published Kimi K2 trainer: 32 nodes
    assert TrainerLayout.parse("tp=2,pp=2").dp == 1


@pytest.mark.parametrize("text", ["tp=0", "tp=two", "xx=2", "tp"])
def test_parse_errors(text: str) -> None:
    with pytest.raises(LayoutError, match="layout"):
        TrainerLayout.parse(text)


def test_megatron_rank_order() -> None:
    t = TrainerLayout(tp=2, pp=2, dp=2, ep=2, etp=1)
    coords = [t.coord(r) for r in range(t.world)]
    assert [c.tp for c in coords] == [0, 1] * 4
    assert [c.dp for c in coords] == [0, 0, 1, 1] * 2
    assert [c.pp for c in coords] == [0] * 4 + [1] * 4
    # experts tile the stage's tp·dp ranks: etp fastest, then ep, then edp
    assert [c.ep for c in coords[:4]] == [0, 1, 0, 1]
    assert [c.edp for c in coords[:4]] == [0, 0, 1, 1]
    assert list(t.stage_ranks(1)) == [4, 5, 6, 7]


def test_engine_coords_and_replicas() -> None:
    e = EngineLayout(tp=2, dp=2, ep=4, replicas=2)
    c = e.coord(6)
    assert (c.replica, c.dp, c.tp, c.ep, c.local) == (1, 1, 0, 2, 2)
    assert EngineLayout(tp=2, ep=1).coord(1).ep == 0


@pytest.mark.parametrize(
    ("layers", "stages", "first", "sizes"),
    [(61, 8, True, [8, 8, 8, 8, 8, 7, 7, 7]), (5, 3, False, [2, 2, 1]), (94, 2, True, [47, 47])],
)
def test_split_layers(layers: int, stages: int, first: bool, sizes: list[int]) -> None:
    ranges = split_layers(layers, stages, extra_first=first)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(layers))


@pytest.mark.parametrize(
    ("model", "trainer", "constraint"),
    [
        ("qwen3-moe-tiny", "tp=3", "num_attention_heads (4) % tp"),
        ("qwen3-moe-tiny", "tp=4", "num_key_value_heads (2) % tp"),
        ("qwen3-moe-tiny", "tp=2,ep=3", "num_experts (8) % ep"),
        ("qwen3-moe-tiny", "tp=2,ep=4,dp=1", "tp·dp (2) % ep·etp (4)"),
        ("qwen3-moe-tiny", "pp=5", "pp <= num_hidden_layers (4)"),
        ("qwen3-tiny", "tp=2,ep=2", "ep == etp == 1 for a dense model"),
        ("qwen3-moe-tiny", "tp=2,etp=2,ep=1,dp=1", None),
    ],
)
def test_trainer_validation_names_constraint(model: str, trainer: str, constraint: str | None) -> None:
    cfg = resolve_model(model)
    layout = TrainerLayout.parse(trainer)
    if constraint is None:
        layout.validate(cfg)
        return
    with pytest.raises(LayoutError) as err:
        layout.validate(cfg)
    assert constraint in str(err.value)


@pytest.mark.parametrize(
    ("model", "engine", "constraint"),
    [
        ("qwen3-moe-tiny", "tp=3", "num_attention_heads (4) % tp"),
        ("qwen3-moe-tiny", "tp=2,dp=2,ep=2", "ep in (1, tp·dp = 4)"),
        ("qwen3-moe-tiny", "tp=1,dp=16,ep=16", "num_experts (8) % ep"),
        ("qwen3-tiny", "tp=2,ep=2", "ep == 1 for a dense model"),
        ("qwen3-moe-tiny", "tp=4", None),  # tp > kv heads: KV heads replicate
    ],
)
def test_engine_validation_names_constraint(model: str, engine: str, constraint: str | None) -> None:
    cfg = resolve_model(model)
    layout = EngineLayout.parse(engine)
    if constraint is None:
        layout.validate(cfg)
        return
    with pytest.raises(LayoutError) as err:
        layout.validate(cfg)
    assert constraint in str(err.value)


def test_published_layouts_are_valid() -> None:
    TrainerLayout.parse("tp=4,pp=2,ep=8,dp=2").validate(resolve_model("qwen3-235b-a22b"))
    EngineLayout.parse("dp=16,ep=16").validate(resolve_model("qwen3-235b-a22b"))
    TrainerLayout.parse("tp=8,pp=8,ep=32,dp=4").validate(resolve_model("kimi-k2"))
    EngineLayout.parse("tp=32,ep=32").validate(resolve_model("kimi-k2"))


def test_a_label_reads_back_as_the_layout_that_wrote_it() -> None:
    for text, replicas in (("tp=2,ep=2", 2), ("tp=1", 1), ("tp=4,dp=2,ep=8,pp=2", 16)):
        engine = EngineLayout.parse(text, replicas)
        layout, n = split_label(engine.label())
        assert EngineLayout.parse(layout, n) == engine
    trainer = TrainerLayout.parse("tp=2,pp=2,ep=2")
    assert split_label(trainer.label()) == (trainer.label(), 1)
    assert split_label(None) == ("", 1)
    assert compact_label("tp=2,dp=1,ep=2,pp=1 x2") == "tp=2,ep=2 x2"
    assert compact_label("tp=1,dp=1,ep=1,pp=1 x1") == "tp=1"
    assert compact_label(trainer.label()) == "tp=2,pp=2,ep=2"


def test_reading_a_layout_label_loads_no_torch() -> None:
    """Reports and plots read layout labels; the model package loads its tensor table (torch) only when used."""
    code = "import sys, kvmove.models.layout, kvmove.bench.runs; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"
