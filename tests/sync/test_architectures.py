"""Real syncs of the architectures whose tensor tables come from transformers' own models: from a Megatron-style
source through the processes launcher and through Ray, and from a real FSDP2 trainer (Mixtral's and GLM-4.5's
experts fused in memory, located by transformers' conversion mapping; gpt-oss's and Llama 4's fused in the
checkpoint too), each verified bit-exact against what the engine's own loader makes of the full checkpoint. The
default suite runs one model per path; ``-m slow`` runs the whole matrix."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.run import run_syncs
from kvmove.sync.strategies import parse_strategies

LAYOUTS = {  # (trainer, engine): MoE models over expert-parallel ranks on both sides
    "llama3-tiny": ("tp=2", "tp=2"),
    "mistral-tiny": ("tp=2,pp=2", "tp=2"),
    "gemma2-tiny": ("tp=2", "tp=1,pp=2"),
    "mixtral-tiny": ("tp=2,ep=2", "tp=2,ep=2"),
    "glm4-moe-tiny": ("tp=2,ep=2", "tp=2"),
    "gpt-oss-tiny": ("tp=2,ep=2,etp=2", "tp=2"),  # fused experts cut over EP and ETP at once
    "llama4-tiny": ("tp=2,ep=2", "tp=2,ep=2"),
}
ARCHS = list(LAYOUTS)


def _config(model: str, launcher: str, **kw: object) -> SyncConfig:
    trainer, engine = LAYOUTS[model]
    base: dict[str, object] = dict(
        model=resolve_model(model),
        trainer=TrainerLayout.parse(trainer),
        engine=EngineLayout.parse(engine),
        strategies=tuple(parse_strategies("v1,v2,v3")),
        transport="gloo",
        verify=True,
        placement=Placement(launcher=launcher),
        deadline_s=120.0,
    )
    base.update(kw)
    return SyncConfig(**base)  # type: ignore[arg-type]


def _check(config: SyncConfig) -> None:
    results = list(run_syncs(config))
    assert [r.strategy for r in results] == ["v1", "v2", "v3"]
    for r in results:
        assert r.verified is True and r.live_engines == config.engine.world, (r.strategy, r.mismatches, r.notes)


def _slow(*models: str) -> list[object]:
    """The default suite syncs one model per path; the rest of the matrix runs with ``-m slow``."""
    return [m if i == 0 else pytest.param(m, marks=pytest.mark.slow) for i, m in enumerate(models)]


@pytest.mark.parametrize("model", _slow("mixtral-tiny", *(m for m in ARCHS if m != "mixtral-tiny")))
def test_megatron_style_source_through_processes(model: str) -> None:
    _check(_config(model, "processes"))


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("model", _slow("gemma2-tiny", *(m for m in ARCHS if m != "gemma2-tiny")))
def test_megatron_style_source_through_ray(model: str) -> None:
    _check(_config(model, "ray"))


@pytest.mark.parametrize("model", _slow("mixtral-tiny", *(m for m in ARCHS if m != "mixtral-tiny")))
def test_fsdp2_trainer_source(tmp_path: Path, model: str) -> None:
    pytest.importorskip("transformers")
    from kvmove.sync.sources.tiny_trainer import TinyFsdpTrainer

    config = _config(
        model,
        "processes",
        trainer=TrainerLayout(dp=2),
        # transformers keeps GLM-4.5's router in FP32 and FSDP2 shards one dtype: FP32 masters, a BF16 image
        source=TinyFsdpTrainer(save_dir=str(tmp_path), master=model == "glm4-moe-tiny"),
        reference=str(tmp_path / "step-{version}"),
    )
    _check(config)
