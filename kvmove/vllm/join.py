"""A vLLM worker joins a kvmove trainer by address: from init info alone, in whatever process vLLM put it.

``init_weight_transfer_engine`` hands each worker the trainer's :class:`~kvmove.sync.embedded.member.JoinInfo`
(registry address, the run's key, transport, deadline: plain JSON). The worker derives kvmove's model config
from the config vLLM serves, dry-runs vLLM's own loader on its meta-device model (the plan) and builds its staging
window (kvmove.vllm.stage), opens its own transport endpoint and registers plan and endpoint with the
trainer's registry; its puller is built from the ``PullerInit`` it fetches at the first ``update_weights``.
Nothing here needs kvmove's launchers or Ray, so it works in vLLM's default multi-process engine, the ``uni``
executor and ``AsyncLLM`` alike; the tensor-parallel ranks of one engine share a replica key (tensor-parallel
rank 0 picks it and broadcasts it on vLLM's own group).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvmove.models.config import ModelConfig, config_from_dict
from kvmove.models.layout import EngineLayout
from kvmove.sync.embedded.member import FleetMember, JoinInfo, Seat
from kvmove.sync.ranks.host import die_after
from kvmove.sync.strategies import parse_strategies
from kvmove.vllm.session import Received, Session


def served_model(vllm_config: Any) -> ModelConfig:
    """kvmove's config of the model vLLM serves (the checkpoint tensors every sync moves): the model directory's
    own config.json where vLLM serves a local directory, else the HF config vLLM holds (transformers' spelling)."""
    name = str(vllm_config.model_config.model)
    path = Path(name) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else vllm_config.model_config.hf_config.to_dict()
    return config_from_dict(raw, name)


def seat(vllm_config: Any) -> Seat:
    """This worker's place: its engine's replica key (shared by the engine's tensor-parallel ranks) and rank."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if tp == 1:
        return Seat(uuid.uuid4().hex, 0, 1)
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    box = [uuid.uuid4().hex if group.rank_in_group == 0 else None]
    dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
    return Seat(str(box[0]), int(group.rank_in_group), tp)


def join(
    s: Session, info: JoinInfo, vllm_config: Any, device: Any, staging: Callable[[EngineLayout, int], Any]
) -> None:
    """Plan this rank and build its staging (``staging(layout, rank)``: a kvmove.vllm.stage.Staging), register
    with the trainer, and make ``s``'s puller and release hook pull/close."""
    from kvmove.vllm.receiver import ReceiveTarget, StagedRank

    model = served_model(vllm_config)
    place = seat(vllm_config)
    built = staging(EngineLayout(tp=place.tp), place.local)
    assert s.plan is not None

    def rank(target: Any, plan: Any, recv: Any) -> StagedRank:
        return StagedRank(target, plan, recv, built.stager, built.budget)

    member = FleetMember(info, place, model, ReceiveTarget(built.stager), s.plan, device, rank=rank)
    s.puller, s.release, s.joined = _puller(member), member.close, info


def _puller(member: FleetMember) -> Any:
    names = frozenset(r.hf_name for r in member.plan.regions)

    def pull(update: dict[str, Any]) -> Received:
        """One sync: into the live model and the staging window; a sync moves every tensor of the plan."""
        (strategy,) = parse_strategies(str(update["strategy"]))
        hook = die_after(update.get("die_after_pulls"))
        stats = member.run(int(update["sync_id"]), strategy, float(update.get("delay_s", 0.0)), hook)
        return Received(stats, names)

    return pull
