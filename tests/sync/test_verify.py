"""In-process verification of entries read directly in pieces (a region spanning several trainer raw shards):
each piece is read from the raw shard of the rank routed to serve it, so a wrong piece route is caught."""

from __future__ import annotations

from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.sync.config import SyncConfig
from kvmove.sync.driver.dryrun import build_plans
from kvmove.sync.planning.direct import DirectPlanner
from kvmove.sync.planning.ownership import Ownership
from kvmove.sync.planning.routing import route
from kvmove.sync.strategies import STRATEGIES
from kvmove.sync.verify import verify_plans


def test_pieces_are_verified_from_the_shards_they_are_routed_to() -> None:
    v3 = STRATEGIES["v3"]
    config = SyncConfig(resolve_model("qwen3-moe-tiny"), TrainerLayout.parse("tp=2"), EngineLayout(), (v3,))
    plans, _ = build_plans(config)
    ownership = Ownership(config.model, config.trainer)
    smap = route(plans, config.engine, ownership, v3, DirectPlanner(ownership, hf_tensors(config.model)))
    assert smap.pieces  # tp=2 shards, one engine rank: attention and MLP regions span both
    assert verify_plans(config.model, config.engine, plans, ownership, smap, v3.scope).ok
    key, pieces = next(iter(smap.pieces.items()))
    swapped = tuple((other, piece) for (_, piece), (other, _) in zip(pieces, pieces[::-1], strict=True))
    bad = smap._replace(pieces={**smap.pieces, key: swapped})  # each piece read from the other rank's shard
    result = verify_plans(config.model, config.engine, plans, ownership, bad, v3.scope)
    assert not result.ok
    *pieces_bad, param_bad = result.mismatches
    assert len(pieces_bad) == 2 and all("does not hold the piece" in m for m in pieces_bad), result.mismatches
    assert param_bad == "engine rank 0: model.embed_tokens.weight"  # never written: not the loader's bits
