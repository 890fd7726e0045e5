"""What one engine rank's direct reads look like per layout (pure planning, CPU, no bytes move).

Run: python examples/direct_read_plans.py [model] [layers]   (default: qwen3-235b-a22b 2, the GPU suite's 1-GPU slice)
Prints, per layout of the GPU suite's matrix (colocated on one GPU, v3, engine rank 0): reads, byte spans, the
copies they fold into (2-D and 1-D), bytes in 2-D copies, the 2-D row widths, the split between executors
``kvmove.transport.executors.assign_executors`` makes, the whole plan's kernel launches and tiles, and how long
checking the spans takes when not prepared (``Transport.prepare`` checks them once, at init).
"""

import sys
import time

import numpy as np

from kvmove.bench.matrix import LAYOUTS
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.sync.config import Placement, SyncOptions
from kvmove.sync.planning.blueprint import Blueprint
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.planning.plan import plan_engine
from kvmove.sync.strategies import parse_strategies
from kvmove.transport.base import BufferDesc, check_ranges
from kvmove.transport.copies import HEIGHT, WIDTH, CopyPlan, plan_copies
from kvmove.transport.executors import assign_executors
from kvmove.transport.tiling import plan_tiles


def main(model: str, layers: int) -> None:
    cfg = resolve_model(model, {"num_hidden_layers": layers})
    for layout in LAYOUTS:
        tl, el = TrainerLayout.parse(layout.trainer), EngineLayout.parse(layout.engine, layout.replicas)
        devices = DeviceMap.of(Placement("processes", ("cuda:0",), colocated=True), tl.world, el.world)
        plans = plan_engine(cfg, el)
        bp = Blueprint(cfg, tl, el, plans, parse_strategies("v3"), SyncOptions(), devices=devices, strided=True)
        runs = [np.asarray(r) for p in bp.pulls["v3"][0].pulls for _, r in p.direct]
        if not runs:
            print(f"{layout.label}: no direct reads")
            continue
        big = BufferDesc("-", "-", 0, 1 << 62)
        start = time.perf_counter()
        checked = [check_ranges(big, big, r) for r in runs]
        check_s = time.perf_counter() - start
        plan = CopyPlan(np.concatenate([plan_copies(c).copies for c in checked]))
        two = plan.strided
        widths = dict(zip(*np.unique(two[:, WIDTH], return_counts=True), strict=True))
        tiles = plan_tiles(plan)
        print(
            f"{layout.label}: {len(runs)} reads, {sum(map(len, runs))} spans -> {plan.ncopies} copies "
            f"({len(two)} 2-D), {plan.nbytes / 1e9:.2f} GB ({(two[:, WIDTH] * two[:, HEIGHT]).sum() / 1e9:.2f} GB "
            f"in 2-D; row widths: copies { ({int(k): int(v) for k, v in widths.items()}) }); executors "
            f"{_split(plan)}; the whole plan as kernel launches: "
            f"{len(tiles.launches)} ({tiles.ntiles} tiles); checking spans unprepared {check_s * 1e3:.1f} ms"
        )


def _split(plan: CopyPlan) -> str:
    parts = assign_executors(plan, peer=False, available=frozenset({"driver", "triton"}))
    return " + ".join(f"{name} {part.ncopies} copies {part.nbytes / 1e9:.2f} GB" for name, part in parts)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-235b-a22b", int(sys.argv[2]) if len(sys.argv) > 2 else 2)
