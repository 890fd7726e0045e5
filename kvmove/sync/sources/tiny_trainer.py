"""A tiny real trainer behind a weight source: an HF ``transformers`` model of a preset, sharded with FSDP2
(``fully_shard`` per decoder layer, then the root) over the trainer ranks, trained with AdamW on synthetic
tokens, one optimizer step per sync, its full state dict saved with ``save_pretrained`` after every step.

It is what the tests and examples plug into a sync (``SyncConfig.source``): a :class:`TinyFsdpTrainer` is a
picklable ``SourceContext -> FsdpSource`` factory, run inside each trainer rank's process. The saved checkpoint
(``save_dir/step-N``) is what engines are verified against (``SyncConfig.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from kvmove.errors import MissingDependencyError
from kvmove.models.config import ModelConfig
from kvmove.models.table import hf_tensors
from kvmove.sync.ranks.source import SourceContext
from kvmove.sync.sources.fsdp import FsdpSource


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError(
            "the FSDP2 trainer builds transformers models: pip install 'kvmove[train]'"
        ) from None
    return transformers


def hf_model(cfg: ModelConfig, seed: int, device: str = "cpu") -> torch.nn.Module:
    """A randomly initialized transformers model of ``cfg`` in bf16 (the same on every rank for one seed)."""
    from kvmove.models.directory import hf_config

    transformers = import_transformers()
    config = transformers.AutoConfig.for_model(**hf_config(cfg))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.to(device)


def init_group(ctx: SourceContext) -> Any:
    """The default process group of the trainer ranks (FSDP2's mesh needs one), from the context's store."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD
    timeout = timedelta(seconds=ctx.timeout_s)
    store = dist.TCPStore(ctx.store.host, ctx.store.port, ctx.layout.world, ctx.rank == 0, timeout=timeout)
    backend = "nccl" if ctx.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.layout.world, timeout=timeout)
    return dist.group.WORLD


def shard(model: torch.nn.Module, world: int, device: str, tp: int = 1, master: bool = False) -> Any:
    """FSDP2 over the data-parallel ranks: each decoder layer, then the root. With ``tp`` > 1 the mesh is 2-D
    (dp, tp) and each dense MLP is tensor-parallel first (gate/up column-wise, down row-wise), FSDP2 then
    sharding those DTensors over dp. ``master``: the (FP32) parameters compute in BF16, gradients reduce in FP32
    (FSDP2's ``MixedPrecisionPolicy``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as _fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if master else None

    def fully_shard(module: Any, mesh: Any) -> None:
        if policy is None:
            _fully_shard(module, mesh=mesh)
        else:
            _fully_shard(module, mesh=mesh, mp_policy=policy)

    kind = device.split(":")[0]
    mesh = init_device_mesh(kind, (world // tp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 else None
    dp = mesh["dp"] if mesh is not None else init_device_mesh(kind, (world,))
    decoder: Any = model.get_submodule("model")
    for layer in decoder.layers:
        if mesh is not None and hasattr(layer.mlp, "gate_proj"):
            plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
            parallelize_module(layer.mlp, mesh["tp"], plan)
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return mesh or dp


@dataclass(frozen=True)
class TinyFsdpTrainer:
    """``SourceContext -> FsdpSource``: builds, shards and trains the model of ``ctx.model`` (see module docstring)."""

    save_dir: str | None = None
    """Where ``step`` saves ``step-N`` checkpoints (None: no checkpoint)."""
    lr: float = 1e-2
    batch: int = 2
    seq_len: int = 16
    arena: bool = True
    tp: int = 1
    """Tensor-parallel ranks of a 2-D (dp, tp) mesh (dense MLPs only; 1: a 1-D data-parallel mesh)."""
    master: bool = False
    """Mixed precision as RL trainers run it: FP32 master parameters (AdamW steps them), BF16 compute, and a BF16
    image is what syncs serve and checkpoints hold (False: BF16 parameters stepped in place)."""

    def __call__(self, ctx: SourceContext) -> FsdpSource:
        group = init_group(ctx)
        model = hf_model(ctx.model, ctx.seed, ctx.device)
        if self.master:
            model = model.float()
        shard(model, ctx.layout.world, ctx.device, self.tp, self.master)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr)
        run = _Steps(self, ctx, model, optimizer)
        order = [t.name for t in hf_tensors(ctx.model)]
        image = torch.bfloat16 if self.master else None
        return FsdpSource(model, group, order, arena=self.arena, on_step=run, image_dtype=image)


class _Steps:
    """One optimizer step on this data-parallel replica's synthetic batch, then the checkpoint (every rank joins
    its gather)."""

    def __init__(self, spec: TinyFsdpTrainer, ctx: SourceContext, model: torch.nn.Module, optimizer: Any) -> None:
        self.spec, self.ctx, self.model, self.optimizer = spec, ctx, model, optimizer
        self.losses: list[float] = []

    def __call__(self, version: int) -> None:
        c, spec = self.ctx, self.spec
        dp_rank = c.rank // spec.tp  # tensor-parallel ranks of one data-parallel replica see the same batch
        g = torch.Generator().manual_seed(c.seed * 7919 + version * 131 + dp_rank)
        tokens = torch.randint(0, c.model.vocab_size, (spec.batch, spec.seq_len), generator=g).to(c.device)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(float(loss.detach()))
        if spec.save_dir is not None:
            image = torch.bfloat16 if spec.master else None
            save_checkpoint(self.model, Path(spec.save_dir) / f"step-{version}", c.rank, image)


def save_checkpoint(model: torch.nn.Module, directory: Path, rank: int, dtype: torch.dtype | None = None) -> None:
    """``save_pretrained`` of the full state dict (a collective gather; rank 0 writes), rounded to ``dtype`` (the
    BF16 image of FP32 masters) where given."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from kvmove.models.table import memory_tensors

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    held = memory_tensors(model)  # NOTE: a tied head is the embedding; gathered, it is a tensor of its own
    state = {k: v for k, v in state.items() if k in held}
    if dtype is not None:
        state = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    if rank == 0:
        model.save_pretrained(str(directory), state_dict=state, safe_serialization=True)  # type: ignore[operator]
