"""Operation counts of a measured sync row's own setup (pulls, served pulls, yields, tensors, kept bytes),
from the simulator's traffic: what turns a measured phase into a per-operation cost."""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from typing import Any, NamedTuple

from kvmove.bench.sim.builder import build_traffic
from kvmove.bench.sim.hardware import GPUS, Cluster
from kvmove.bench.sim.setup import SimSetup, Spec, TrainerSpec
from kvmove.bench.sim.strategies import SIM_STRATEGIES
from kvmove.bench.sim.traffic import Traffic
from kvmove.errors import KvmoveError
from kvmove.models import model_totals, resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout, split_label


class Counts(NamedTuple):
    """Per sync, from the row's traffic: the busiest engine rank's pulls, the busiest trainer rank's served
    pulls, yields and collectives, tensors in the checkpoint, and bytes one engine rank keeps."""

    pulls: float
    calls: float
    yields: float
    tensors: float
    kept: float
    quant: float = 0.0
    """BF16 bytes the busiest trainer rank quantizes to FP8 (an FP8 engine, quantized on the trainer)."""
    gathers: float = 0.0
    """Collectives (all-gathers, broadcasts) the busiest trainer rank runs per sync, and the bytes they bring it."""
    gathered: float = 0.0


def row_counts(r: Any) -> Counts | None:
    """Counts of a measured sync row's own setup (None when its model or layout cannot be rebuilt)."""
    e = r["extra_d"]
    overrides = json.dumps(e.get("model_overrides", {}), sort_keys=True)
    try:
        return _counts(
            str(r["model"]),
            str(r["trainer"]),
            str(r["engine"]),
            str(r["strategy"]),
            int(r["bytes"]),
            bool(e.get("direct", False)),
            overrides,
            str(e.get("engine_dtype") or "bf16"),
        )
    except (KvmoveError, ValueError, KeyError):
        return None


@lru_cache(maxsize=256)
def _counts(
    model: str, trainer: str, engine: str, strategy: str, nbytes: int, direct: bool, overrides: str, dtype: str
) -> Counts:
    layout, reps = split_label(engine)
    changes = json.loads(overrides)
    base = resolve_model(model, changes or None)
    cfg = base if changes else _layers_matching(base, nbytes)
    s = SimSetup(
        cfg,
        TrainerSpec("megatron", TrainerLayout.parse(trainer)),
        EngineLayout.parse(layout, reps),
        Cluster(GPUS["h200"]),
        trainer_nodes=64,
        engine_nodes=64,
        direct=direct and strategy in ("v2", "v3"),
        dtype=dtype,
        quantize_on="trainer" if dtype == "fp8" else "engine",
    )
    chosen = SIM_STRATEGIES[strategy]
    t: Traffic = build_traffic(s, dataclasses.replace(chosen, grouping="layer", pipelined=False))
    if chosen.grouping == "tensor":  # one pull per tensor and keeper: the regions it keeps
        pulls, calls = t.total("engine", "regions").max(), t.total("trainer", "regions").max()
    else:
        t = build_traffic(s, chosen)
        pulls, calls = t.total("engine", "pulls").max(), t.total("trainer", "calls").max()
    return Counts(
        pulls=float(pulls),
        calls=float(calls),
        yields=float(t.total("trainer", "yield").max()),
        tensors=float(model_totals(cfg).num_tensors),
        kept=float(t.total("engine", "kept").max()),
        quant=float(t.total("trainer", "quant").max()),
        gathers=_busiest(t, 0),
        gathered=_busiest(t, 1),
    )


def _busiest(t: Traffic, which: int) -> float:
    """The busiest trainer rank's collectives (``which`` 0) or collective bytes (1) over the sync."""
    per_rank = [(pair[which] * t.count[:, None]).sum(axis=0) for pair in t.gather.values()]
    return float(sum(per_rank).max()) if per_rank else 0.0


def _layers_matching(cfg: Any, nbytes: int) -> Any:
    """The preset with as many decoder layers as make its checkpoint ``nbytes`` (GPU rows sync a slice)."""
    from dataclasses import replace

    for layers in range(1, cfg.num_hidden_layers + 1):
        candidate = replace(cfg, num_hidden_layers=layers)
        if model_totals(candidate).total_bytes == nbytes:
            return candidate
    return cfg


def mapped_bf16(r: Any) -> float:
    """BF16 bytes the busiest engine rank of a one-GPU FP8 row quantized itself from the trainer's mapped arena
    (``kvmove.bench.sim.mapped``), in the row's own setup: its model slice and layouts, colocated on its GPU over
    cuda-ipc. 0 when the row's setup cannot be rebuilt or maps nothing."""
    e, gpu = r["extra_d"], r["gpu"]
    overrides = tuple(f"{k}={v}" for k, v in sorted((e.get("model_overrides") or {}).items()))
    layout, reps = split_label(r["engine"])
    try:
        return _mapped(str(r["model"]), str(r["trainer"]), layout, reps, gpu.name, str(r["strategy"]),
                       bool(e.get("direct", False)), overrides)  # fmt: skip
    except (KvmoveError, ValueError, KeyError, AttributeError):
        return 0.0


@lru_cache(maxsize=64)
def _mapped(
    model: str, trainer: str, engine: str, reps: int, gpu: str, strategy: str, direct: bool, overrides: tuple[str, ...]
) -> float:
    cluster = f"gpu={gpu},nic=cx7-400,gpus_per_node=1,nics_per_node=1"
    spec = Spec(model, trainer, engine, reps, 1, 1, cluster, "colocated", "cuda-ipc", dtype="fp8",
                quantize_on="trainer", direct=direct, overrides=overrides)  # fmt: skip
    t = build_traffic(spec.build(), SIM_STRATEGIES[strategy])
    return float(t.total("engine", "mapped").max(initial=0.0))
