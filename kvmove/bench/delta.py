"""The delta suite (``kvmove bench run --suite delta``): what a delta sync costs on one device, colocated.

A slice of a model (default: Qwen3-235B-A22B at full layer width, 8 decoder layers plus embedding and head:
42.3 GB of BF16) is stepped by the realistic rule of ``kvmove.sync.delta.stepping`` (FP32 master, AdamW at an RL
learning rate, BF16 image), one tensor at a time so that only one tensor's optimizer state is resident. For each
of ``steps`` steps and each tensor it runs the sync's own code, on the device: the dense pack of the new image into
a slot, the trainer's detection and encoding against the image last served (``Images.encode``), and the engine's
patch and landing (``Patch.apply`` and the landing program) into a parameter that holds the previous image; each
landed tensor is checked bit-exact. One row per step: the changed fraction per region class, delta bytes against
dense, and detection + encoding + apply in GB/s of model as a fraction of the same run's device-copy rate.

On a CPU device the same code is its own CI twin (a small model).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvmove.bench.results import Row
from kvmove.errors import KvmoveError
from kvmove.models.tensors import TensorMeta
from kvmove.sync.delta.apply import Patch
from kvmove.sync.delta.detect import Images, summary
from kvmove.sync.delta.stepping import AdamwStep, SteppedWeights
from kvmove.sync.planning.entries import PLAIN
from kvmove.sync.planning.packing import PartSpec, ServeSpec
from kvmove.sync.planning.plan import Box
from kvmove.sync.programs import ProgramBuilder
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


class _Tensor:
    """One tensor's two sides: the trainer's slot, the engine's parameter, the landing program between them."""

    def __init__(self, meta: TensorMeta, device: str) -> None:
        nbytes = meta.numel * meta.dtype.itemsize
        self.slot = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.recv = torch.empty_like(self.slot)
        self.param = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        box = Box.full(meta.shape)
        self.specs = [
            ServeSpec(PLAIN, meta.name, meta.shape, box, True, (PartSpec("data", None, (), meta.dtype, nbytes),))
        ]
        b = ProgramBuilder()
        b.copy(self.param, self.recv.view(meta.dtype).view(meta.shape))
        self.program = b.build(persistent=True)
        self.sizes = [nbytes]


def delta_bench(bench: DeltaBench, say: Say) -> list[Row]:
    """``bench.steps`` rows (see the module docstring); raises if a landed tensor differs from the image."""
    from kvmove.models import model_totals, resolve_model
    from kvmove.models.tensors import hf_tensors

    cfg = resolve_model(bench.model, {"num_hidden_layers": bench.layers})
    total = model_totals(cfg).total_bytes
    say(f"delta: {cfg.name} with {bench.layers} layers, {total / 1e9:.1f} GB, {bench.steps} steps at lr {bench.lr}")
    copy = device_copy_gbps(bench.device, bench.copy_bytes)
    timers = [_Timer(bench.device) for _ in range(bench.steps)]
    counts: list[list[dict[str, int]]] = [[] for _ in range(bench.steps)]
    for meta in hf_tensors(cfg):
        _tensor_steps(bench, meta, timers, counts)
    rows = []
    for step, (timer, c) in enumerate(zip(timers, counts, strict=True), start=1):
        s = summary(c)
        work = sum(timer.seconds[p] for p in ("detect_encode", "apply"))
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
                },
            )
        )
        frac, ratio = s["changed_fraction_all"], s["ratio"]
        say(f"step {step}: {frac:.4f} changed, {ratio:.3f}x dense bytes, {rows[-1].gbps:.1f} GB/s of model")
    return rows


def _tensor_steps(
    bench: DeltaBench, meta: TensorMeta, timers: list[_Timer], counts: list[list[dict[str, int]]]
) -> None:
    """Every step of one tensor: its master stepped, packed, detected and encoded, applied on the engine side."""
    weights = SteppedWeights(AdamwStep(lr=bench.lr), bench.seed, bench.device)
    t, images, key = _Tensor(meta, bench.device), Images(), ("delta", 0, 0)
    image = weights.tensor(meta, 0)
    t.param.copy_(image)  # the engine holds version 0, and so does the trainer's image
    t.slot.view(meta.dtype).view(meta.shape).copy_(image)
    images.encode(key, t.slot, t.specs, 0, None)
    images.take_counts()
    for step, timer in enumerate(timers, start=1):
        image = weights.tensor(meta, step)
        with timer.phase("pack"):  # the dense pack a sync runs either way
            t.slot.view(meta.dtype).view(meta.shape).copy_(image)
        with timer.phase("detect_encode"):
            coded = images.encode(key, t.slot, t.specs, step, step - 1)
        t.recv[: coded.nbytes].copy_(t.slot[: coded.nbytes])  # the colocated read (not part of the delta's work)
        patch = Patch.of(str(coded.encoding), coded.changed, t.sizes)
        with timer.phase("apply"):
            if patch is not None:
                patch.apply(t.program, t.recv)
            t.program.run()
        if not bits_equal(t.param, image):
            raise KvmoveError(f"delta step {step}: {meta.name} landed differently from its image")
        counts[step - 1].append(images.take_counts())
        with timer.phase("dense_land"):  # the receive slot now holds the whole new payload: a dense landing
            t.program.run()
