"""Which measured rows may set which cost: every row's setup, and every cost's declared setups per target.

A row measures a cost only for the setup it ran: a colocated sync on one GPU, whose trainer ranks gather through
host-memory gloo and whose "transfer" is a device copy, says nothing about an RDMA pull between two GPUs. So each
row gets a :class:`RowSetup` (placement, GPUs used, device kind, data path, how its trainer gathers), and each
cost declares, for each *target* the simulator predicts, which setups may measure it (:class:`Match`). Only
matching rows set a cost, the newest commit among them; rows of another setup, however new, never replace it.

Targets:
- ``cluster``: the full-scale setups (GPUs of separate trainer and engine ranks, NVLink inside a node, NICs
  across): costs from disaggregated GPU rows (two GPUs), GPU ceilings and GPU micro-benchmarks;
- ``one-gpu``: kvmove's own colocated syncs on one GPU (the matrix of ``kvmove bench run --suite gpu --gpus
  1``): costs from colocated one-GPU rows, used to predict held-out one-GPU rows (``kvmove.bench.sim.ownruns``);
- ``cpu``: kvmove's syncs between CPU processes (``kvmove bench run --suite sync``): costs from CPU sync rows,
  used to predict held-out CPU rows (``kvmove.bench.sim.cpuruns``).
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from kvmove.errors import KvmoveError
from kvmove.models.layout import TrainerLayout

PLACEMENTS = ("colocated", "disaggregated")
PATHS = ("ceiling", "micro", "delta", "gpu-copy", "nvlink-ipc", "nixl", "nccl", "host-gloo", "vllm-cpu", "cpu")
"""Data paths: a ceiling or micro-benchmark row; the delta suite's device-memory passes; CUDA-IPC on one device (a
device copy) or across NVLink; NIXL; NCCL (send/recv or broadcast); host-memory gloo; vLLM's CPU engine; any other
CPU row."""


class RowSetup(NamedTuple):
    """What a measured row ran: placement, GPUs, device kind, the sync's data path, how the trainer gathered."""

    placement: str
    gpus: int
    device: str
    path: str
    gather: str
    """"none" (one trainer rank), "nccl" (GPU ranks on separate devices) or "host-gloo" (ranks sharing a GPU)."""
    dtype: str = "bf16"
    """The engine's weight format ("fp8": the trainer quantized what it packed)."""

    def label(self) -> str:
        return f"{self.placement} {self.device} x{self.gpus} {self.path} (gather {self.gather}, {self.dtype})"


class Match(NamedTuple):
    """The setups that may measure a cost."""

    placements: tuple[str, ...]
    paths: tuple[str, ...]
    gathers: tuple[str, ...] = ("none", "nccl")
    device: str = "gpu"
    dtypes: tuple[str, ...] = ("bf16",)

    def __call__(self, s: RowSetup) -> bool:
        return (
            s.device == self.device
            and s.placement in self.placements
            and s.path in self.paths
            and s.gather in self.gathers
            and s.dtype in self.dtypes
        )

    def label(self) -> str:
        return (
            f"{'/'.join(self.placements)} {self.device} {'/'.join(self.dtypes)} via {'/'.join(self.paths)} "
            f"(gather {'/'.join(self.gathers)})"
        )


def row_setup(r: Any) -> RowSetup:
    """The setup of one decorated row (``extra_d`` parsed, ``hardware`` a string)."""
    e = r["extra_d"]
    hardware = str(r["hardware"])
    on_cuda = str(e.get("device") or "").startswith("cuda")  # the delta suite labels the host, not its GPU
    device = "gpu" if hardware.startswith("gpu:") or on_cuda else "cpu"
    found = re.search(r" x(\d+)", hardware)
    gpus = int(found.group(1)) if found and hardware.startswith("gpu:") else int(on_cuda)
    trainer_dev, engine_dev = set(e.get("trainer_devices") or ()), set(e.get("engine_devices") or ())
    if trainer_dev and engine_dev:
        placement = "colocated" if trainer_dev & engine_dev else "disaggregated"
        gpus = len(trainer_dev | engine_dev) if device == "gpu" else gpus
    else:
        placement = str(e.get("placement") or ("disaggregated" if gpus != 1 else "colocated"))
    dtype = str(e.get("engine_dtype") or "bf16")
    return RowSetup(placement, gpus, device, _path(r, device, placement), _gather(r, trainer_dev, device), dtype)


def _path(r: Any, device: str, placement: str) -> str:
    name, suite, transport = str(r["name"]), str(r["suite"]), str(r.get("transport") or "")
    if name.startswith("ceiling ") and not str(r.get("strategy") or ""):
        return "ceiling"
    if suite in ("micro", "delta"):
        return suite
    if suite == "vllm" and device == "cpu":
        return "vllm-cpu"
    if device == "cpu":
        return "cpu"
    if transport == "cuda-ipc":
        return "gpu-copy" if placement == "colocated" else "nvlink-ipc"
    if transport.startswith("nccl"):
        return "nccl"
    return {"nixl": "nixl", "gloo": "host-gloo"}.get(transport, "cpu")


def _gather(r: Any, trainer_devices: set[str], device: str) -> str:
    try:
        world = TrainerLayout.parse(str(r.get("trainer") or "")).world if r.get("trainer") else 1
    except KvmoveError:
        world = 1
    if world <= 1:
        return "none"
    if device == "cpu" or (trainer_devices and len(trainer_devices) < world):
        return "host-gloo"
    return "nccl"


def model_layers(r: Any) -> int | None:
    """Decoder layers of the slice a GPU row synced (``extra.model_overrides``), None for the whole preset."""
    overrides = r["extra_d"].get("model_overrides") or {}
    if isinstance(overrides, str):
        overrides = json.loads(overrides)
    value = overrides.get("num_hidden_layers") if isinstance(overrides, dict) else None
    return int(value) if value is not None else None


ANY = PLACEMENTS
_DISAGG_SYNC = Match(("disaggregated",), ("nixl", "nvlink-ipc", "nccl"))
_DISAGG_V1 = Match(("disaggregated",), ("nixl", "nvlink-ipc"))
_ONE_GPU = Match(("colocated",), ("gpu-copy",), gathers=("none",))
_FP8_SYNC = Match(ANY, ("gpu-copy", "nvlink-ipc", "nixl", "nccl"), dtypes=("fp8",))
"""FP8 syncs: the trainer's pack is the sync's own batched quantize programs (``kvmove.quant``); a device-local
pass, so its rate on one GPU is its rate on any GPU of a cluster."""
_DELTA = Match(("colocated",), ("delta",))
"""The delta suite on a GPU: detection and apply as device-memory passes of the sync's own code."""
_NO_ROWS = Match((), ())
"""No row of ours can measure it (fitted on published figures, ``kvmove.bench.sim.fitting``)."""

CLUSTER: dict[str, Match] = {
    "copy_efficiency": Match(ANY, ("ceiling",)),
    "p2p_efficiency": Match(ANY, ("ceiling",)),
    "nccl_efficiency": Match(ANY, ("ceiling",)),
    "h2d_efficiency": Match(ANY, ("ceiling",)),
    "pull_efficiency": Match(("disaggregated",), ("nixl",)),
    "push_efficiency": _NO_ROWS,
    "ipc_efficiency": Match(("disaggregated",), ("nvlink-ipc",)),
    "pack_efficiency": _DISAGG_SYNC,
    "load_efficiency": _DISAGG_SYNC,
    "quantize_efficiency": _FP8_SYNC,
    "delta_detect_efficiency": _DELTA,
    "delta_apply_efficiency": _DELTA,
    "request_s": _DISAGG_V1,
    "materialize_s": _DISAGG_V1,
    "pack_call_s": _DISAGG_V1,
    "load_call_s": _DISAGG_V1,
    "pull_op_s": _DISAGG_V1,
    "collective_s": Match(ANY, ("micro",)),
    "broadcast_op_s": Match(("disaggregated",), ("nccl",)),
    "reload_layer_s": _NO_ROWS,
    "cold_s_per_byte": _DISAGG_SYNC,
    "sync_s": _NO_ROWS,
}
"""Full-scale targets: rows of separate GPUs only, and device-local passes measured on any GPU (FP8 quantization,
delta detection and apply). The per-layer reload of a GPU engine is measured by no row of ours (the vLLM suite
runs vLLM's CPU engine): it is fitted. A sync's driver work outside its phases (``sync_s``) is measured on CPU rows
only so far, and kept at 0 for GPU targets. The micro-benchmark's quantizer (``kvmove.bench.micro.quantize_blocks``,
pure torch) is not the sync's and sets nothing."""

ONE_GPU: dict[str, Match] = {
    **CLUSTER,
    "ipc_efficiency": _ONE_GPU,
    "pack_efficiency": _ONE_GPU,
    "load_efficiency": _ONE_GPU,
    "request_s": _ONE_GPU,
    "materialize_s": _ONE_GPU,
    "pack_call_s": _ONE_GPU,
    "load_call_s": _ONE_GPU,
    "pull_op_s": _ONE_GPU,
    "broadcast_op_s": _NO_ROWS,
    "cold_s_per_byte": _ONE_GPU,
    "sync_s": _ONE_GPU,
    "quantize_efficiency": _ONE_GPU._replace(dtypes=("fp8",)),
}
"""kvmove's colocated one-GPU syncs: CUDA-IPC on one device is a device copy; costs from one-GPU rows, the sync's
fixed cost (``sync_s``) included: direct one-GPU syncs measure it (seconds - their transfer phase)."""

_CPU_SYNC = Match(PLACEMENTS, ("cpu",), gathers=("none", "host-gloo"), device="cpu")
"""kvmove's syncs between CPU processes of one host: NIXL over loopback and gloo, the trainer's ranks gathering
through gloo."""
_CPU_COSTS = (
    "pull_efficiency", "nccl_efficiency", "pack_efficiency", "load_efficiency", "request_s", "materialize_s",
    "pack_call_s", "load_call_s", "pull_op_s", "collective_s", "broadcast_op_s", "cold_s_per_byte", "sync_s",
)  # fmt: skip
CPU: dict[str, Match] = {name: _CPU_SYNC if name in _CPU_COSTS else _NO_ROWS for name in CLUSTER}
"""kvmove's CPU syncs (the sync suite, ``kvmove.bench.sim.cpuruns``): costs from CPU sync rows only, rates over the
host's own loopback read (``kvmove.bench.sim.hardware.host_of_run``); no GPU row sets any of them, and no CPU row
sets a GPU target's cost. A CPU run's broadcast rate (``nccl_efficiency``) is its raw gloo broadcast
(``kvmove.bench.rawcast``); no CPU row measures a copy or pinned-copy ceiling: those keep their defaults."""

TARGETS: dict[str, dict[str, Match]] = {"cluster": CLUSTER, "one-gpu": ONE_GPU, "cpu": CPU}
