"""The delta suite (``kvmove bench run --suite delta``): what a delta sync costs on one device, colocated.

A slice of a model (default: Qwen3-235B-A22B at full layer width, 8 decoder layers plus embedding and head:
42.3 GB of BF16) is stepped by the realistic rule of ``kvmove.sync.delta.stepping`` (FP32 master, AdamW at an RL
learning rate, BF16 image), one pull at a time so that only one layer's optimizer state is resident. For each
of ``steps`` steps and each pull (the tensors of one decoder layer, as a v3 pull of one block carries them; every
other tensor alone) it runs the sync's own code, on the device: the trainer's detection and encoding of the new
image (updated in place, as an optimizer step writes it) against the image last served, straight from the
tensors into the slot (``Images.serve``), and the engine's scatter of the delta into parameters that hold the
previous image (``Patch.apply``); each landed tensor is checked bit-exact. For comparison, the same pull's dense
pack and dense landing are timed too. One row per step: the changed fraction per region class, delta bytes against
dense, and detection + encoding + apply in GB/s of model as a fraction of the same run's device-copy rate.

On a CPU device the same code is its own CI twin (a small model).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from kvmove.bench.results import Row
from kvmove.errors import KvmoveError
from kvmove.models.tensors import TensorMeta
from kvmove.sync.delta.apply import Patch
from kvmove.sync.delta.detect import Images, summary
from kvmove.sync.delta.stepping import AdamwStep, SteppedWeights
from kvmove.sync.planning.entries import PLAIN
from kvmove.sync.planning.packing import PartSpec, ServeSpec, pack_layout
from kvmove.sync.planning.plan import Box
from kvmove.sync.programs import Program, ProgramBuilder
from kvmove.sync.verify import bits_equal

Say = Callable[[str], None]


@dataclass(frozen=True)
class DeltaBench:
    """What one run measures (the defaults: the one-H200 run)."""

    model: str = "qwen3-235b-a22b"
    layers: int = 8
    steps: int = 5
    lr: float = 1e-6
    device: str = "cuda:0"
    seed: int = 0
    copy_bytes: int = 2 << 30

    @classmethod
    def cpu_twin(cls, model: str = "qwen3-moe-tiny", layers: int = 2, steps: int = 5) -> DeltaBench:
        return cls(model=model, layers=layers, steps=steps, device="cpu", copy_bytes=64 << 20)


class _Timer:
    """Seconds per phase, summed over tensors (the device synchronized around each)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def device_copy_gbps(device: str, nbytes: int, repeats: int = 5) -> float:
    """Read+write bytes per second of one device-to-device copy (median of ``repeats``)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    timer, times = _Timer(device), []
    b.copy_(a)
    for _ in range(repeats):
        timer.seconds.clear()
        with timer.phase("copy"):
            b.copy_(a)
        times.append(timer.seconds["copy"])
    return 2 * nbytes / sorted(times)[len(times) // 2] / 1e9


class _Pull:
    """One pull's two sides (the tensors of one decoder layer, as a v3 pull of one block carries them): the
    trainer's sources (the BF16 image, updated in place each step) and slot, the engine's receive slot and
    parameters, and the programs between them."""

    def __init__(self, metas: list[TensorMeta], device: str) -> None:
        self.metas = metas
        self.sizes = [m.numel * m.dtype.itemsize for m in metas]
        self.layout = pack_layout(self.sizes)
        self.slot = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=device)
        self.recv = torch.empty_like(self.slot)
        self.sources = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
        self.params = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
        self.specs = [
            ServeSpec(PLAIN, m.name, m.shape, Box.full(m.shape), True, (PartSpec("data", None, (), m.dtype, n),))
            for m, n in zip(metas, self.sizes, strict=True)
        ]
        self.serve = self._program(zip(self.views(self.slot), self.sources, strict=True))
        self.dense_pack = self._program(zip(self.views(self.recv), self.sources, strict=True))
        self.land = self._program(zip(self.params, self.views(self.recv), strict=True))

    @staticmethod
    def _program(copies: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Program:
        b = ProgramBuilder()
        for dst, src in copies:
            b.copy(dst, src)
        return b.build(persistent=True)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's part of ``buf``, typed and shaped."""
        return [
            buf[o : o + n].view(m.dtype).view(m.shape)
            for m, n, o in zip(self.metas, self.sizes, self.layout.offsets, strict=True)
        ]

    def landed(self) -> bool:
        return all(bits_equal(p, i) for p, i in zip(self.params, self.sources, strict=True))


def pulls(metas: list[TensorMeta]) -> list[list[TensorMeta]]:
    """Tensors grouped by decoder layer (``model.layers.N.``); every other tensor is a pull of its own."""
    groups: dict[str, list[TensorMeta]] = {}
    for m in metas:
        parts = m.name.split(".")
        key = ".".join(parts[:3]) if m.name.startswith("model.layers.") else m.name
        groups.setdefault(key, []).append(m)
    return list(groups.values())


def delta_bench(bench: DeltaBench, say: Say) -> list[Row]:
    """``bench.steps`` rows (see the module docstring); raises if a landed tensor differs from the image."""
    from kvmove.models import model_totals, resolve_model
    from kvmove.models.table import hf_tensors
    from kvmove.sync.delta import warm

    cfg = resolve_model(bench.model, {"num_hidden_layers": bench.layers})
    total = model_totals(cfg).total_bytes
    say(f"delta: {cfg.name} with {bench.layers} layers, {total / 1e9:.1f} GB, {bench.steps} steps at lr {bench.lr}")
    copy = device_copy_gbps(bench.device, bench.copy_bytes)
    for side in ("trainer", "engine"):  # as ranks do at init
        warm(torch.device(bench.device), side)
    timers = [_Timer(bench.device) for _ in range(bench.steps)]
    counts: list[list[dict[str, int]]] = [[] for _ in range(bench.steps)]
    for group in pulls(hf_tensors(cfg)):
        _pull_steps(bench, group, timers, counts)
    rows = []
    for step, (timer, c) in enumerate(zip(timers, counts, strict=True), start=1):
        s = summary(c)
        work = sum(timer.seconds[p] for p in ("detect_encode", "apply"))
        dense = timer.seconds["pack"] + timer.seconds["dense_land"]
        rows.append(
            Row(
                kind="measured",
                suite="delta",
                name=f"delta step {step}",
                model=cfg.name,
                bytes=s["sent_bytes"],
                seconds=work,
                gbps=total / work / 1e9,
                phases={k: round(v, 6) for k, v in timer.seconds.items()},
                extra={
                    "device": bench.device,
                    "step": step,
                    "lr": bench.lr,
                    "layers": bench.layers,
                    "model_bytes": total,
                    "dense_bytes": s["dense_bytes"],
                    "delta_ratio": s["ratio"],
                    "changed_fraction": s["changed_fraction"],
                    "changed_fraction_all": s["changed_fraction_all"],
                    "pulls": s["pulls"],
                    "device_copy_gbps": copy,
                    "fraction_of_device_copy": total / work / 1e9 / copy,
                    "dense_land_gbps": total / timer.seconds["dense_land"] / 1e9,
                    "dense_seconds": dense,
                    "seconds_vs_dense": work / dense,
                },
            )
        )
        frac, ratio = s["changed_fraction_all"], s["ratio"]
        say(
            f"step {step}: {frac:.4f} changed, {ratio:.3f}x dense bytes, {rows[-1].gbps:.1f} GB/s of model, "
            f"{work / dense:.2f}x the seconds of a dense pack and landing"
        )
    return rows


def _pull_steps(
    bench: DeltaBench, metas: list[TensorMeta], timers: list[_Timer], counts: list[list[dict[str, int]]]
) -> None:
    """Every step of one pull: its masters stepped, packed, detected and encoded, applied on the engine side."""
    weights = SteppedWeights(AdamwStep(lr=bench.lr), bench.seed, bench.device)
    t, images, key = _Pull(metas, bench.device), Images(), ("delta", 0, 0)
    for m, src, param in zip(metas, t.sources, t.params, strict=True):
        src.copy_(weights.tensor(m, 0))
        param.copy_(src)  # the engine holds version 0, and so will the trainer's image
    images.serve(key, t.serve, t.slot, t.specs, 0, None)
    images.take_counts()
    target = None
    for step, timer in enumerate(timers, start=1):
        for m, src in zip(metas, t.sources, strict=True):  # the optimizer's step writes the image in place
            src.copy_(weights.tensor(m, step))
        with timer.phase("detect_encode"):
            coded = images.serve(key, t.serve, t.slot, t.specs, step, step - 1)
        t.recv[: coded.nbytes].copy_(t.slot[: coded.nbytes])  # the colocated read (not part of the delta's work)
        patch = Patch.of(str(coded.encoding), coded.changed, t.sizes)
        if patch is not None and target is None:
            target = patch.target(t.params)  # built once per pull, as an engine's lander keeps it
        with timer.phase("apply"):
            if patch is None:
                t.land.run()
            elif target is not None:
                patch.apply(target, t.recv)
        if not t.landed():
            raise KvmoveError(f"delta step {step}: {metas[0].name} (and its pull) landed differently from the image")
        counts[step - 1].append(images.take_counts())
        with timer.phase("pack"):  # what a dense sync does instead: pack every byte, land every byte
            t.dense_pack.run()
        with timer.phase("dense_land"):
            t.land.run()
