"""The WeightSource seam: a second source, written here from scratch (a plain dict of torch tensors sharded by
hand, its own torch.distributed process group), syncs and verifies through both launchers; init step 1 refuses
a source whose shards do not tile a tensor (kvmove's own source: whose shards differ from the trainer layout)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.models.weights import seeded_tensor
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.run import run_syncs
from kvmove.sync.driver.running import check_ownership
from kvmove.sync.planning.plan import Box
from kvmove.sync.ranks.control import Address, TrainerHello
from kvmove.sync.ranks.source import Gathered, SourceContext, WeightSource
from kvmove.sync.strategies import Gather, parse_strategies

COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROWS = ("o_proj", "down_proj")


def split_dim(name: str) -> int | None:
    """Megatron tensor parallelism of a dense model, by hand: column-parallel weights split their rows,
    row-parallel ones their columns, norms are replicated."""
    leaf = name.split(".")[-2]
    return 0 if leaf in COLUMNS else 1 if leaf in ROWS else None


def shard_box(t: TensorMeta, rank: int, world: int) -> Box:
    dim, start, stop = split_dim(t.name), [0] * len(t.shape), list(t.shape)
    if dim is not None:
        n = t.shape[dim] // world
        start[dim], stop[dim] = rank * n, (rank + 1) * n
    return Box(tuple(start), tuple(stop))


class DictSource(WeightSource):
    """A trainer rank of a tensor-parallel dense model: ``{name: shard}``, gathered with ``all_gather``."""

    def __init__(self, ctx: SourceContext) -> None:
        self.rank, self.world, self.seed = ctx.rank, ctx.layout.world, ctx.seed
        self.metas = hf_tensors(ctx.model)
        self.weights: dict[str, torch.Tensor] = {}
        init = f"tcp://{ctx.store.host}:{ctx.store.port}"
        dist.init_process_group("gloo", init_method=init, rank=ctx.rank, world_size=self.world)

    def metadata(self) -> Sequence[TensorMeta]:
        return self.metas

    def _box(self, t: TensorMeta) -> Box:
        return shard_box(t, self.rank, self.world)

    def shards(self) -> Mapping[str, Box]:
        return {t.name: self._box(t) for t in self.metas}

    def held_names(self, scope: Gather) -> set[str] | None:
        return set() if scope is Gather.ROOT and self.rank else None

    def step(self, version: int) -> None:
        for t in self.metas:
            self.weights[t.name] = seeded_tensor(t, self.seed, version)[self._box(t).slices()].clone()

    def materialize(self, names: Sequence[str], scope: Gather) -> Iterator[Gathered]:
        keep = scope is not Gather.ROOT or self.rank == 0
        for name in names:
            shard, dim = self.weights[name], split_dim(name)
            if dim is None:
                yield Gathered(name, shard if keep else None, False)
                continue
            parts = [torch.empty_like(shard) for _ in range(self.world)]
            dist.all_gather(parts, shard)
            yield Gathered(name, torch.cat(parts, dim) if keep else None, True)


def dict_source(ctx: SourceContext) -> WeightSource:
    return DictSource(ctx)


def _config(launcher: str) -> SyncConfig:
    return SyncConfig(
        model=resolve_model("qwen3-tiny"),
        trainer=TrainerLayout.parse("tp=2"),
        engine=EngineLayout.parse("tp=2"),
        strategies=tuple(parse_strategies("v1,v2,v3,broadcast")),
        verify=True,
        seed=5,
        placement=Placement(launcher=launcher),
        source=dict_source,
    )


@pytest.mark.parametrize("launcher", ["processes", "ray"])
def test_a_second_weight_source_syncs_and_verifies(launcher: str, request: pytest.FixtureRequest) -> None:
    if launcher == "ray":
        ray = request.getfixturevalue("ray_session")
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import tests/
    results = list(run_syncs(_config(launcher)))
    assert [r.strategy for r in results] == ["v1", "v2", "v3", "broadcast"]
    assert all(r.verified and r.live_engines == 2 for r in results), [r.mismatches for r in results]
    assert any("no arena" in n for n in results[0].notes)  # no arena: every region packed
    assert len({r.bytes for r in results[:3]}) == 1


def test_a_source_whose_shards_do_not_tile_a_tensor_is_refused() -> None:
    config = _config("processes")
    address = Address("127.0.0.1", 0)
    hellos = [
        TrainerHello(r, 0, address, tuple((t.name, shard_box(t, r, 2)) for t in hf_tensors(config.model)), None)
        for r in range(2)
    ]
    declared = check_ownership(config, hellos)
    assert declared.arenas is None  # no arena: valid, every region packed
    assert declared.ownership.slices(hf_tensors(config.model)[0])  # the shards as the ranks declared them
    (name, box), *rest = hellos[1].shards
    wrong = Box((0, *box.start[1:]), (box.stop[0] - box.start[0], *box.stop[1:]))  # rank 0's half, not its own
    hellos[1] = hellos[1]._replace(shards=((name, wrong), *rest))
    with pytest.raises(KvmoveError, match=rf"the shards trainer ranks hold of {name} .* do not tile it"):
        check_ownership(config, hellos)
    # kvmove's own seeded source (no SyncConfig.source) must hold exactly what the layout's rules give each rank
    with pytest.raises(KvmoveError, match=rf"trainer rank 1 (does not )?hold.* {name}, unlike the trainer layout"):
        check_ownership(replace(config, source=None), hellos)


def test_fused_experts_cut_on_two_dims_reassemble_from_the_gather_group() -> None:
    """gpt-oss under ep=2, etp=2: each rank's box of gate_up_proj is cut on dims 0 and 2; its gather group's
    flat shards, placed by their boxes, give back the full tensor (what ShardedSource's stage gather returns)."""
    from kvmove.sync.planning.ownership import Ownership
    from kvmove.sync.ranks.source import assemble

    cfg, layout = resolve_model("gpt-oss-tiny"), TrainerLayout.parse("tp=2,ep=2,etp=2")
    own = Ownership(cfg, layout)
    for meta in hf_tensors(cfg, layers=[1]):
        if ".experts." not in meta.name:
            continue
        full = seeded_tensor(meta, 0, 0)
        boxes = dict(own.slices(meta))
        for rank in range(layout.world):
            group = sorted(own.gather_group(meta, rank))
            rows = torch.stack([full[boxes[r].slices()].reshape(-1) for r in group])
            assert torch.equal(assemble(meta, [boxes[r] for r in group], rows), full), (meta.name, rank)
