"""GPU and NIC presets (vendor figures, sources cited) and the cluster a simulated sync runs on.

Units: every preset keeps the vendor's convention and says so; :class:`Cluster` turns them into bytes/s.
``nvlink_gbps``, ``pcie_gbps`` and ``hbm_gbps`` are **gigabytes**/s (NVLink and PCIe per direction: half the
vendor's bidirectional figure); ``nic_gbps`` is **gigabits**/s per NIC port. The sources are listed in
``docs/simulator.md`` with the figures taken from each.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmove.errors import KvmoveError

GB = 1e9

_NV_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
_NV_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_MLC_H200 = (
    "https://github.com/mlcommons/inference_results_v4.1/blob/main/closed/NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json"
)
_MLC_B200 = "https://github.com/mlcommons/inference_results_v6.0/blob/main/closed/Nebius/systems/nebius_b200_n1.json"
_NV_HGX = "https://www.nvidia.com/en-us/data-center/hgx/"
_H20 = "https://tweakers.net/nieuws/215984/nvidia-stelt-release-ai-chip-voor-chinese-markt-uit-naar-begin-2024.html"
_H800 = "https://www.tomshardware.com/news/nvidia-gimps-h100-hopper-gpu-to-sell-as-h800-to-china"
_CX7 = "https://docs.nvidia.com/networking/display/800GMMA4Z00NS/Overview"
_HOST = (
    "no vendor figures: ranks as processes of one host over loopback; its rates are its own run's, given as "
    "nvlink_gbps (the link), hbm_gbps and pcie_gbps"
)


@dataclass(frozen=True)
class Gpu:
    """One GPU model: memory bandwidth (GB/s, read+write), NVLink and PCIe (GB/s per direction)."""

    name: str
    hbm_gbps: float
    nvlink_gbps: float
    pcie_gbps: float
    memory_gb: float
    source: str
    cores: float = 0
    """A CPU host's cores: how many of its processes' copies progress at once at its line rate (0: a GPU, no such
    bound). Its hardware's cores, or fewer (a fraction) where its run measured fewer (:func:`parallel_of_run`)."""


@dataclass(frozen=True)
class Nic:
    """One NIC port: line rate in gigabits/s."""

    name: str
    nic_gbps: float
    source: str


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("h100", 3350, 450, 64, 80, f"{_NV_H100} (SXM: 3.35 TB/s HBM3, NVLink 900 GB/s, PCIe Gen5 128 GB/s)"),
        Gpu("h200", 4800, 450, 64, 141, f"{_NV_H200}; {_MLC_H200} (18x NVLink4 900 GB/s, PCIe Gen5 x16)"),
        Gpu("h20", 4000, 450, 64, 96, f"{_H20} (96 GB HBM3, 4 TB/s; NVLink as H100's 900 GB/s)"),
        Gpu("h800", 3350, 200, 64, 80, f"{_H800} (H100 die, NVLink cut to 400 GB/s bidirectional)"),
        Gpu("b200", 8000, 900, 64, 180, f"{_NV_HGX}; {_MLC_B200} (180 GB HBM3e, NVLink5 1.8 TB/s per GPU)"),
        Gpu("cpu", 0, 0, 0, 0, _HOST),
    )
}

NICS: dict[str, Nic] = {
    n.name: n
    for n in (
        Nic("cx7-400", 400, f"{_CX7} (ConnectX-7 NDR 400 Gb/s port); {_MLC_B200} (8x CX-7 400 Gb/s per node)"),
        Nic("cx7-200", 200, f"{_CX7} (ConnectX-7 at NDR200)"),
        Nic("cx8-800", 800, "https://build.nvidia.com/playbooks/connect-two-stations (ConnectX-8, 800 Gb/s)"),
    )
}

_NUMBERS = ("gpus_per_node", "nics_per_node", "nic_gbps", "nvlink_gbps", "pcie_gbps", "hbm_gbps", "cores")


@dataclass(frozen=True)
class Cluster:
    """Homogeneous nodes of ``gpus_per_node`` GPUs and ``nics_per_node`` NICs (GPUDirect RDMA, rail-optimized)."""

    gpu: Gpu = GPUS["h100"]
    nic: Nic = NICS["cx7-400"]
    gpus_per_node: int = 8
    nics_per_node: int = 8

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """``gpu=h200,nic=cx7-400[,gpus_per_node=8,nics_per_node=8,nic_gbps=..,nvlink_gbps=..,pcie_gbps=..]``.

        Numbers override the preset's (nic_gbps in Gb/s; nvlink/pcie/hbm in GB/s; ``cores``: a CPU host's cores);
        a KvmoveError names a bad key.
        """
        values = _parse_pairs(text)
        gpu = _preset(GPUS, values.pop("gpu", "h100"), "gpu")
        nic = _preset(NICS, values.pop("nic", "cx7-400"), "nic")
        numbers = {k: _number(text, k, v) for k, v in values.items()}
        gpu = _override(gpu, numbers, ("nvlink_gbps", "pcie_gbps", "hbm_gbps", "cores"))
        if gpu.cores and gpu.name.rstrip("*") != "cpu":
            raise KvmoveError(f"cluster spec {text!r}: cores bounds a CPU host's copies (gpu=cpu), not a GPU's")
        if min(gpu.nvlink_gbps, gpu.pcie_gbps, gpu.hbm_gbps) <= 0:
            raise KvmoveError(
                f"cluster spec {text!r}: gpu={gpu.name.rstrip('*')} has no vendor figures: give nvlink_gbps, "
                "hbm_gbps and pcie_gbps (its own measured rates)"
            )
        nic = _override(nic, numbers, ("nic_gbps",))
        gpn = int(numbers.get("gpus_per_node", 8))
        return cls(gpu, nic, gpn, int(numbers.get("nics_per_node", gpn)))

    @property
    def host(self) -> bool:
        """A CPU host (``gpu=cpu``): its "GPUs" are processes, its collectives gloo's."""
        return self.gpu.name.rstrip("*") == "cpu"

    @property
    def nvlink_rate(self) -> float:
        return self.gpu.nvlink_gbps * GB

    @property
    def pcie_rate(self) -> float:
        return self.gpu.pcie_gbps * GB

    @property
    def hbm_rate(self) -> float:
        """Bytes/s the memory reads plus writes; a copy moves each byte twice, so it copies at half of this."""
        return self.gpu.hbm_gbps * GB

    @property
    def gpu_nic_rate(self) -> float:
        """Bytes/s one GPU pushes through its share of the node's NICs, capped by its PCIe link."""
        share = self.nic.nic_gbps / 8 * GB * self.nics_per_node / self.gpus_per_node
        return min(share, self.pcie_rate)

    @property
    def node_nic_rate(self) -> float:
        return self.nics_per_node * self.nic.nic_gbps / 8 * GB

    def label(self) -> str:
        if self.host:
            cores = f" on {self.gpu.cores:.3g} cores" if self.gpu.cores else ""
            return (
                f"{self.gpus_per_node} CPU processes/node{cores} over loopback at {self.gpu.nvlink_gbps:.3g} GB/s, "
                f"memory {self.gpu.hbm_gbps:.3g} GB/s"
            )
        return (
            f"{self.gpus_per_node}x{self.gpu.name.upper()}/node, {self.nics_per_node}x{self.nic.nic_gbps:g} Gb/s NICs, "
            f"NVLink {self.gpu.nvlink_gbps:g} GB/s/dir, HBM {self.gpu.hbm_gbps:g} GB/s"
        )

    def spec(self) -> str:
        """The flag text that rebuilds this cluster."""
        return (
            f"gpu={self.gpu.name.rstrip('*')},nic={self.nic.name.rstrip('*')},gpus_per_node={self.gpus_per_node},"
            f"nics_per_node={self.nics_per_node},nic_gbps={self.nic.nic_gbps:g},nvlink_gbps={self.gpu.nvlink_gbps:g},"
            f"pcie_gbps={self.gpu.pcie_gbps:g},hbm_gbps={self.gpu.hbm_gbps:g}"
            + (f",cores={self.gpu.cores:.17g}" if self.gpu.cores else "")
        )


def gpu_of_hardware(label: str) -> Gpu | None:
    """The preset a results row's hardware label names (``gpu:H200 x2`` -> h200), else None."""
    text = label.lower()
    if not text.startswith("gpu:"):
        return None
    model = text[4:].split()[0] if len(text) > 4 else ""
    for name, gpu in GPUS.items():
        if model.startswith(name) or model.endswith(name):
            return gpu
    return None


def host_of_run(raw_gbps: float, cores: float = 0) -> Gpu:
    """A CPU host as the sync suite measured it: its raw loopback read (``extra.raw_gbps``, GB/s) is the line rate
    of its link and of a copy between its processes (a loopback read is that copy), so memory moves at twice it
    (read plus write) and host<->"device" copies at it; ``cores`` (:func:`parallel_of_run`) bound how many of its
    processes' transfers progress at once."""
    host = GPUS["cpu"]
    note = f"{host.source}; the run's raw loopback read: {raw_gbps:g} GB/s" + (f", {cores:.3g} cores" if cores else "")
    return dataclasses.replace(host, name="cpu*", hbm_gbps=2 * raw_gbps, nvlink_gbps=raw_gbps, pcie_gbps=raw_gbps,
                               cores=cores, source=note)  # fmt: skip


def parallel_of_run(cores: int, speedup: float | None) -> float:
    """How many line-rate copies a CPU host ran at once: its ``cores``, or fewer where its run's raw read by several
    processes at once moved only ``speedup`` times what one process read alone (the same message size, the same
    run: ``kvmove.bench.sim.samples.concurrent_speedups``), at least 1. 0 when the cores are not known."""
    if not cores:
        return 0.0
    return float(cores) if not speedup or speedup <= 0 else min(float(cores), max(1.0, speedup))


def cores_of_hardware(label: str) -> int:
    """A CPU host's cores from a results row's hardware label (``cpu:AMD EPYC x2`` -> 2), else 0."""
    found = re.search(r" x(\d+)$", label.strip())
    return int(found.group(1)) if label.startswith("cpu:") and found else 0


def _parse_pairs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    known = ("gpu", "nic", *_NUMBERS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise KvmoveError(f"cluster spec {text!r}: {part!r} is not one of {', '.join(known)}=VALUE")
        out[key] = raw.strip()
    return out


def _preset(table: dict[str, Any], name: str, what: str) -> Any:
    if name.lower() not in table:
        raise KvmoveError(f"unknown {what} {name!r} (known: {', '.join(table)})")
    return table[name.lower()]


def _number(text: str, key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise KvmoveError(f"cluster spec {text!r}: {key} must be a number, got {raw!r}") from None
    if value <= 0 or not math.isfinite(value):
        raise KvmoveError(f"cluster spec {text!r}: {key} must be positive")
    if key in ("gpus_per_node", "nics_per_node") and value != int(value):
        raise KvmoveError(f"cluster spec {text!r}: {key} must be a whole number")
    if key == "cores" and value < 1:
        raise KvmoveError(f"cluster spec {text!r}: cores must be at least 1 (a fraction: cores' worth of copies)")
    return value


def _override(preset: Any, numbers: dict[str, float], keys: tuple[str, ...]) -> Any:
    changed = {k: numbers[k] for k in keys if k in numbers}
    changed = {k: v for k, v in changed.items() if v != getattr(preset, k)}
    if not changed:
        return preset
    note = ", ".join(f"{k}={v:g}" for k, v in changed.items())
    return dataclasses.replace(preset, **changed, name=f"{preset.name}*", source=f"{preset.source}; user flags {note}")


ROUNDS: dict[str, dict[str, Callable[[int], int]]] = {
    "gloo": {"all_gather": lambda n: n - 1, "broadcast": lambda n: max(1, math.ceil(math.log2(n)))},
    "nccl": {"all_gather": lambda n: 1, "broadcast": lambda n: 1},
}
"""Steps of one collective among ``n`` members, each priced at ``broadcast_op_s`` (and, for a broadcast's root,
a copy of its bytes per step): gloo, the collectives of CPU processes, all-gathers around a ring and broadcasts
along a binomial tree whose root sends once per round
(https://github.com/facebookincubator/gloo/blob/main/gloo/allgather.cc,
https://github.com/facebookincubator/gloo/blob/main/gloo/broadcast.cc); an NCCL call is one operation."""


def library(c: Cluster) -> str:
    """The collective library between a cluster's ranks: gloo between CPU processes, NCCL between GPUs."""
    return "gloo" if c.host else "nccl"


def rounds(c: Cluster, n: int) -> int:
    """Steps of one collective keyed as the traffic keys them (``n`` > 0: an all-gather over n, < 0: a broadcast
    to -n members)."""
    table = ROUNDS[library(c)]
    return table["all_gather"](n) if n > 0 else table["broadcast"](-n)
