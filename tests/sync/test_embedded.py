"""A sync run from inside a framework's processes (kvmove.sync.embedded), on the reference engine (no vLLM).

The CPU twin of kvmove's vLLM trainer engine: the trainer hosts its rank in this process over a re-iterable
``(name, tensor)`` source shaped like vLLM's ``WeightSource``; the "engine client" stands in for vLLM's four
calls: its init hands the join info to two engine replicas, each of which registers the plan of its own loader
by address (``FleetMember``), and its update pulls into both at once. Every sync is checked bit-exact against
the reference engine's loader fed the same checkpoint.
"""

from __future__ import annotations

import pytest
from embedded_engines import DictSource, Engines

from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.table import hf_tensors
from kvmove.models.weights import seeded_checkpoint
from kvmove.sync.delta.stepping import AdamwStep, SteppedWeights
from kvmove.sync.embedded.trainer import EmbeddedTrainer, TrainerSettings

MODEL = "qwen3-tiny"


@pytest.mark.parametrize("strategy", ["v1", "v3"])
def test_three_syncs_from_the_framework_process_are_bit_exact(strategy: str) -> None:
    cfg = resolve_model(MODEL)
    engines = Engines(cfg)
    weights = dict(seeded_checkpoint(cfg, 1, 1))
    source = DictSource(weights)
    trainer = EmbeddedTrainer(0, source, engines, TrainerSettings(strategy=strategy))
    try:
        assert trainer.fleet.layout.replicas == 2
        for version in (2, 3, 4):
            weights.update(seeded_checkpoint(cfg, 1, version))  # a training step, in place
            stats = trainer.sync(weight_version=str(version))
            assert stats.bytes_served > 0
            assert engines.mismatches(weights) == [], f"sync to version {version}"
        steps = [["start", "update", f"finish {v}"] for v in (2, 3, 4)]
        assert engines.calls == [call for step in steps for call in step]
    finally:
        trainer.close()
        engines.close()


def test_delta_syncs_from_the_framework_process_move_only_what_a_step_changed() -> None:
    cfg = resolve_model(MODEL)
    engines = Engines(cfg)
    stepped = SteppedWeights(AdamwStep(lr=1e-6), seed=1)
    metas = hf_tensors(cfg)
    weights = {t.name: stepped.tensor(t, 0) for t in metas}
    trainer = EmbeddedTrainer(0, DictSource(weights), engines, TrainerSettings(strategy="v3", delta=True))
    try:
        served, by_cost = [], []
        for version in (1, 2, 3):
            weights.update({t.name: stepped.tensor(t, version) for t in metas})  # an optimizer step
            stats = trainer.sync(weight_version=str(version))
            assert engines.mismatches(weights) == [], f"sync to version {version}"
            served.append(stats.delta["sent_bytes"])
            by_cost.append(stats.delta.get("pulls.dense_by_cost", 0) == stats.delta.get("pulls.dense", 0))  # counts
            assert stats.delta["dense_bytes"] == served[0]
        assert served[1] < 0.2 * served[0]  # a first sync is dense, the next all deltas (no verdict on cost yet)
        # then a pull whose delta cost more than packing it (the clock decides: on a loaded host, it may) goes
        # dense by cost, and only so
        assert served[2] < 0.2 * served[0] or by_cost[2]
    finally:
        trainer.close()
        engines.close()


def test_a_transport_engines_cannot_open_alone_is_refused() -> None:
    cfg = resolve_model(MODEL)
    source = DictSource(dict(seeded_checkpoint(cfg, 1, 1)))
    with pytest.raises(KvmoveError, match=r"'gloo' needs one fixed group"):
        EmbeddedTrainer(0, source, Engines(cfg), TrainerSettings(transport="gloo"))


def test_a_source_that_does_not_match_the_engines_model_is_refused() -> None:
    cfg = resolve_model(MODEL)
    weights = dict(seeded_checkpoint(cfg, 1, 1))
    missing = next(t.name for t in hf_tensors(cfg))
    del weights[missing]
    engines = Engines(cfg)
    try:
        with pytest.raises(KvmoveError, match=f"does not match the engines' model: missing {missing}"):
            EmbeddedTrainer(0, DictSource(weights), engines, TrainerSettings())
    finally:
        engines.close()


def test_an_engine_side_that_registers_nothing_is_a_clear_error() -> None:
    cfg = resolve_model(MODEL)
    engines = Engines(cfg, replicas=0)
    with pytest.raises(KvmoveError, match="no engine rank registered"):
        EmbeddedTrainer(0, DictSource(dict(seeded_checkpoint(cfg, 1, 1))), engines, TrainerSettings())


@pytest.mark.parametrize("model", ["mixtral-tiny", "glm4-moe-tiny"])
def test_a_source_named_as_transformers_holds_the_model_in_memory_syncs_bit_exact(model: str) -> None:
    """A transformers 5 model's state dict names Mixtral's and GLM-4.5's experts fused (``mlp.experts.gate_up_proj``,
    every expert of a layer), the checkpoint and the engines per expert (``block_sparse_moe.experts.E.w1.weight``):
    transformers' own conversion says which rows of which fused tensor each checkpoint tensor is."""
    from transformers.core_model_loading import revert_weight_conversion

    from kvmove.sync.sources.tiny_trainer import hf_model

    cfg = resolve_model(model)
    trained = hf_model(cfg, seed=3)
    in_memory = dict(trained.state_dict())  # parameters and persistent buffers (GLM-4.5's router score bias)
    assert any(n.endswith(".mlp.experts.gate_up_proj") for n in in_memory)
    engines = Engines(cfg)
    trainer = EmbeddedTrainer(0, DictSource(in_memory), engines, TrainerSettings(strategy="v3"))
    try:
        trainer.sync(weight_version="1")
        checkpoint = revert_weight_conversion(trained, in_memory)  # what save_pretrained writes
        assert {t.name for t in hf_tensors(cfg)} <= set(checkpoint)
        assert engines.mismatches(checkpoint) == []
    finally:
        trainer.close()
        engines.close()


def test_a_source_without_a_buffer_the_checkpoint_holds_is_refused_by_name() -> None:
    """GLM-4.5's router score bias is a buffer of transformers' model: a source of its parameters alone (vLLM's
    ModuleSource) lacks a tensor the engines load."""
    from kvmove.sync.sources.tiny_trainer import hf_model

    cfg = resolve_model("glm4-moe-tiny")
    params = {n: p.detach() for n, p in hf_model(cfg, seed=3).named_parameters()}
    engines = Engines(cfg)
    try:
        with pytest.raises(KvmoveError, match=r"missing model\.layers\.1\.mlp\.gate\.e_score_correction_bias"):
            EmbeddedTrainer(0, DictSource(params), engines, TrainerSettings())
    finally:
        engines.close()
