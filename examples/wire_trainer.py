"""How an RL framework wires its trainer into kvmove: an FSDP2 trainer as the weight source, three v3 syncs into
the reference engine, each verified. Run: python examples/wire_trainer.py (needs kvmove[train])."""

import torch

from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.table import hf_tensors
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.run import run_syncs
from kvmove.sync.sources.fsdp import FsdpSource
from kvmove.sync.sources.tiny_trainer import hf_model, init_group, shard
from kvmove.sync.strategies import STRATEGIES


def my_trainer(ctx):  # runs in each trainer rank's process
    group = init_group(ctx)  # torch.distributed over the trainer ranks
    model = hf_model(ctx.model, ctx.seed)  # any transformers model of the checkpoint
    shard(model, ctx.layout.world, ctx.device)  # fully_shard per decoder layer, then the root
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(version):  # called before every sync: the framework's own step
        tokens = torch.randint(0, ctx.model.vocab_size, (2, 16))
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()

    names = [t.name for t in hf_tensors(ctx.model)]  # checkpoint order
    return FsdpSource(model, group, names, on_step=train_step)


if __name__ == "__main__":
    config = SyncConfig(
        model=resolve_model("qwen3-moe-tiny"),
        trainer=TrainerLayout(dp=2),
        engine=EngineLayout.parse("tp=2"),
        strategies=(STRATEGIES["v3"],),
        syncs=3,
        transport="gloo",
        source=my_trainer,
        placement=Placement(launcher="processes"),
    )
    for result in run_syncs(config):
        print(f"sync {result.sync}: {result.seconds:.3f} s, {result.bytes} bytes")
