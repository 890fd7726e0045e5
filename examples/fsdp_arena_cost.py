"""Per-step cost of the FSDP source's arena refresh vs. gathering the tensors a rank holds (2 ranks, CPU gloo).

Run: python examples/fsdp_arena_cost.py qwen3-moe-small
Prints, per rank: arena bytes, then per step (copy seconds, gather seconds, gather / copy).
"""

import sys
import time

import torch.multiprocessing as mp


def run(rank: int, port: int, model: str, out: mp.Queue) -> None:
    from kvmove.models import resolve_model
    from kvmove.models.layout import TrainerLayout
    from kvmove.sync.ranks.control import Address
    from kvmove.sync.ranks.source import SourceContext
    from kvmove.sync.sources.tiny_trainer import TinyFsdpTrainer
    from kvmove.sync.strategies import Gather

    ctx = SourceContext(resolve_model(model), TrainerLayout(dp=2), rank, "cpu", 0, Address("127.0.0.1", port), 300.0)
    src = TinyFsdpTrainer()(ctx)
    src.on_step = None  # the copy alone, not the training step
    held = src.held_names(Gather.STAGE) or set()
    names = [m.name for m in src.metadata() if m.name in held]
    rows = []
    for _ in range(3):
        src.step(1)
        t0 = time.perf_counter()
        for _gathered in src.materialize(names, Gather.STAGE):
            pass
        rows.append((src.last_copy_seconds, time.perf_counter() - t0))
    arena = src.arena()
    out.put((rank, arena[0].numel() if arena else 0, rows))


if __name__ == "__main__":
    from kvmove.sync.ranks.collectives import free_port

    spawn = mp.get_context("spawn")
    port, queue = free_port(), spawn.Queue()
    procs = [spawn.Process(target=run, args=(r, port, sys.argv[1], queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    for rank, nbytes, rows in results:
        print(rank, nbytes, [(round(c, 4), round(g, 4), round(g / c, 1)) for c, g in rows])
