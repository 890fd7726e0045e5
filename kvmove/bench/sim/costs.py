"""The simulator's costs: each a value with its provenance (the result rows it came from, or a named default).

Every cost is one of:
- ``measured``: one measured quantity over a vendor figure (an efficiency) or over a count, median of rows;
- ``derived``: arithmetic on several measured quantities of the same rows (a phase minus its bytes term);
- ``fitted``: least squares over rows (marked, so a reader knows it has no single measurement behind it);
- ``default``: no measurement of ours yet; a named value that the report flags;
- ``user``: set by a flag or a file.

Published figures never set a cost: they only validate (``kvmove.bench.sim.validation``).
Efficiencies are fractions of a line rate and must lie in (0, 1]: above 1 a prediction would beat its own speed
of light, so such a value is refused wherever it comes from.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from kvmove.errors import KvmoveError

KINDS = ("measured", "derived", "fitted", "default", "user")

_VIME_ISSUE = "https://github.com/vllm-project/vime/issues/175"
_VIME_PR = "https://github.com/vllm-project/vime/pull/176"
_SCAN_PR = "https://github.com/sgl-project/sglang/pull/19299"
_VLLM_LOADER = "https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/deepseek_v2.py"
LOADER_SCAN_S = 6.67 / 179e6
"""One expert-mapping entry compared against a tensor's name: 6.67 s over ~179M comparisons (``_SCAN_PR``)."""
_VIME_EXPERTS = 128
"""Routed experts of the model behind the vime figures (Qwen3-30B-A3B)."""


def expert_scan(num_experts: int) -> float:
    """Expert-mapping entries a MoE engine's own loader compares per tensor it loads: the mapping holds three
    entries per routed expert (gate, up, down) and the loop stops at the match, half way on average
    (``_VLLM_LOADER``, ``load_weights``; SGLang's loaders scan the same way, and so did vLLM's Qwen3-MoE in the
    engines of the published figures: by vLLM 0.32 it hands experts to ``FusedMoE.load_weights``, which indexes
    the mapping by expert). Tensors outside the experts, a few percent of a MoE checkpoint's, are counted alike."""
    return 1.5 * num_experts


class RowRef(NamedTuple):
    """One results row a cost was computed from."""

    commit: str
    suite: str
    name: str
    setup: str
    hardware: str

    def label(self) -> str:
        return f"{self.commit[:8]} {self.suite}/{self.name} [{self.setup}] on {self.hardware}"


class CostSpec(NamedTuple):
    """A cost's unit, meaning and its default (used, and flagged, only while no rows measure it)."""

    name: str
    unit: str
    """"fraction" (of a line rate, in (0, 1]), "s" (per operation) or "s/B"."""
    meaning: str
    default: float | str
    """A number, or the name of another cost whose value it takes."""
    source: str = ""
    """Where the default comes from, when it is a public measurement or a framework's own code (a URL and what
    was read there); empty for a named default with no source."""


SPECS: dict[str, CostSpec] = {
    s.name: s
    for s in (
        CostSpec("copy_efficiency", "fraction", "device-to-device copy rate / the GPU's HBM bandwidth", 0.8),
        CostSpec("p2p_efficiency", "fraction", "peer copy over NVLink / NVLink line rate (one direction)", 0.8),
        CostSpec("nccl_efficiency", "fraction", "NCCL send/recv, broadcast and all-gather / line rate", 0.8),
        CostSpec("h2d_efficiency", "fraction", "pinned host<->device copy / PCIe line rate", 0.8),
        CostSpec("pull_efficiency", "fraction", "RDMA READ pulls (NIXL) during syncs / line rate of the link", 0.8),
        CostSpec("push_efficiency", "fraction", "RDMA WRITE pushes / line rate of the link", "pull_efficiency"),
        CostSpec("ipc_efficiency", "fraction", "CUDA-IPC reads during syncs / NVLink line rate", 0.8),
        CostSpec("pack_efficiency", "fraction", "trainer packing (op replay into a slot) / device copy rate", 0.5),
        CostSpec("load_efficiency", "fraction", "engine scatter from a slot into parameters / device copy rate", 0.5),
        CostSpec(
            "quantize_efficiency", "fraction", "FP8 block quantization into the slot / HBM bandwidth", "copy_efficiency"
        ),
        CostSpec("request_s", "s", "one pull request round trip (engine -> trainer -> ready)", 20e-6),
        CostSpec("materialize_s", "s", "trainer: yield one tensor from the weight source (no collective)", 10e-6),
        CostSpec(
            "pack_call_s", "s", "trainer: replay and pack one pull's regions into its slot, bytes excluded", 10e-6
        ),
        CostSpec("load_call_s", "s", "engine: copy one pull's regions into their parameters, bytes excluded", 10e-6),
        CostSpec("pull_op_s", "s", "one pull's transfer setup and completion, bytes excluded", 10e-6),
        CostSpec("collective_s", "s", "one NCCL all-gather launch and completion, bytes excluded", 20e-6),
        CostSpec("broadcast_op_s", "s", "one NCCL broadcast call (a tensor, or a bucket), bytes excluded", 20e-6),
        CostSpec(
            "reload_layer_s",
            "s",
            "engine: vLLM layer-wise reload of one decoder layer, bytes excluded",
            0.065,
            f"{_VIME_PR} (layer-wise reload bypassed: update_weights_time 24.7 s -> 21.6 s, Qwen3-30B-A3B BF16 on "
            "H200: 3.1 s / 48 decoder layers)",
        ),
        CostSpec("cold_s_per_byte", "s/B", "first (cold) sync: extra seconds per byte registered on a rank", 0.0),
        CostSpec("sync_s", "s", "one sync's driver work outside every phase (commands out, results back)", 0.0),
        CostSpec(
            "nic_efficiency",
            "fraction",
            "RDMA and NCCL traffic through a node's NICs / NIC line rate",
            "pull_efficiency",
        ),
        CostSpec(
            "host_register_s_per_byte", "s/B", "host-memory sources: registering and staging each byte they send", 0.0
        ),
        CostSpec(
            "loader_tensor_s",
            "s",
            "a serving engine's own weight loader (vLLM's or SGLang's load_weights), per tensor it loads, beyond "
            "the scan of its expert mapping (loader_scan_s)",
            14e-3 / 170 - LOADER_SCAN_S * expert_scan(_VIME_EXPERTS),
            f"{_VIME_PR} (vLLM's engine load per chunk 14 ms, packed, without layer-wise reload, H200) and "
            f"{_VIME_ISSUE} (~170 tensors per chunk; Qwen3-30B-A3B, 128 experts): 14 ms / 170 - the scan of "
            "192 mapping entries at loader_scan_s",
        ),
        CostSpec(
            "loader_scan_s",
            "s",
            "a serving engine's MoE loader, per entry of its expert mapping compared against a tensor's name (a "
            "linear scan: 1.5 entries per routed expert per tensor)",
            LOADER_SCAN_S,
            f"{_SCAN_PR}: matching the 180,364 tensor names of DeepSeek-R1-NVFP4 (256 experts) against the mapping "
            f"took 6.67 s over ~179M string comparisons (37 ns each); the scan is {_VLLM_LOADER}'s load_weights "
            "loop over expert_params_mapping",
        ),
        CostSpec(
            "packed_bucket_s",
            "s",
            "vLLM's packed NCCL weight-transfer consumer, per buffer received, beyond its bytes and tensors",
            "broadcast_op_s",
            "vLLM's packed_nccl_broadcast_consumer takes each buffer with one broadcast call and a stream "
            "synchronize (https://github.com/vllm-project/vllm/blob/main/vllm/distributed/weight_transfer/"
            "packed_tensor.py)",
        ),
        CostSpec(
            "delta_detect_efficiency",
            "fraction",
            "trainer: delta detection and encoding, payload bytes compared / device copy rate",
            "pack_efficiency",
        ),
        CostSpec(
            "delta_apply_efficiency",
            "fraction",
            "engine: a delta applied through the landing program (beyond the dense landing), bytes / copy rate",
            "load_efficiency",
        ),
    )
}


@dataclass(frozen=True)
class Cost:
    """One cost's value and where it comes from."""

    name: str
    value: float
    kind: str
    rows: tuple[RowRef, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        check_value(self.name, self.value)
        if self.kind not in KINDS:
            raise KvmoveError(f"cost {self.name}: kind must be one of {', '.join(KINDS)}, not {self.kind!r}")

    @property
    def unit(self) -> str:
        return SPECS[self.name].unit

    def commits(self) -> list[str]:
        """The commits of the rows behind it (a fitted cost: ``figure KEY`` for each training figure)."""
        return sorted({f"figure {r.name}" if r.suite == "published" else r.commit[:8] for r in self.rows})


def check_value(name: str, value: float) -> None:
    """A KvmoveError for an unknown cost, a non-finite or negative value, or an efficiency outside (0, 1]."""
    if name not in SPECS:
        raise KvmoveError(f"unknown cost {name!r} (known: {', '.join(SPECS)})")
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise KvmoveError(f"cost {name} must be a finite number >= 0, got {value!r}")
    if SPECS[name].unit == "fraction" and not 0 < value <= 1:
        raise KvmoveError(
            f"cost {name} = {value:g} refused: an efficiency is a fraction of a line rate in (0, 1]; "
            "above 1 a prediction would beat its own speed of light"
        )


QUANTIZE_TRAFFIC = 1.5
"""HBM bytes FP8 block quantization moves per BF16 byte: it reads 2 B and writes 1 B per element (the FP32 block
scales are a rounding error)."""


@dataclass(frozen=True)
class CostBook:
    """Every cost the simulator prices with, each with its provenance."""

    costs: dict[str, Cost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [n for n in SPECS if n not in self.costs]
        if missing:
            raise KvmoveError(f"cost book lacks {', '.join(missing)}")

    def __getitem__(self, name: str) -> float:
        return self.costs[name].value

    def quantize_seconds(self, bf16: Any, hbm_rate: float) -> Any:
        """Seconds to quantize ``bf16`` BF16 bytes (a number or an array) to FP8 on a GPU of this HBM line rate."""
        return QUANTIZE_TRAFFIC * bf16 / (hbm_rate * self["quantize_efficiency"])

    def defaults(self) -> list[str]:
        """Costs without a measurement of ours (flagged in the report)."""
        return [n for n, c in self.costs.items() if c.kind == "default"]

    def with_values(self, values: dict[str, float], note: str) -> CostBook:
        """A copy with ``values`` set by the user (kind "user"); each value is checked."""
        out = dict(self.costs)
        for name, value in values.items():
            out[name] = Cost(name, float(value), "user", (), note)
        return CostBook(_resolve_inherited(out, set(values)))

    def to_json(self) -> dict[str, Any]:
        return {
            n: {"value": c.value, "kind": c.kind, "rows": [list(r) for r in c.rows], "note": c.note}
            for n, c in self.costs.items()
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostBook:
        costs = {
            n: Cost(
                n, float(d["value"]), str(d["kind"]), tuple(RowRef(*r) for r in d.get("rows", [])), d.get("note", "")
            )
            for n, d in data.items()
            if n in SPECS
        }
        for name in SPECS:
            costs.setdefault(name, _default(name, costs))
        return cls(costs)


def default_book(known: dict[str, Cost] | None = None) -> CostBook:
    """``known`` costs plus every other one at its named default (kind "default")."""
    costs = dict(known or {})
    for name in SPECS:
        if name not in costs:
            costs[name] = _default(name, costs)
    return CostBook(costs)


def _default(name: str, costs: dict[str, Cost]) -> Cost:
    spec = SPECS[name]
    if isinstance(spec.default, str):
        base = costs.get(spec.default) or _default(spec.default, costs)
        note = f"no measurement of ours yet: taken as {spec.default} ({base.kind})" + _cited(spec)
        return Cost(name, base.value, "default", base.rows, note)
    return Cost(name, spec.default, "default", (), "no measurement of ours yet: named default" + _cited(spec))


def _cited(spec: CostSpec) -> str:
    return f"; from {spec.source}" if spec.source else ""


def _resolve_inherited(costs: dict[str, Cost], changed: set[str]) -> dict[str, Cost]:
    """Defaults that inherit another cost follow it when the user changes that cost."""
    out = dict(costs)
    for name, spec in SPECS.items():
        if isinstance(spec.default, str) and out[name].kind == "default" and spec.default in changed:
            out[name] = _default(name, out)
    return out


def parse_cost_flags(items: list[str]) -> dict[str, float]:
    """``["pull_efficiency=0.9", "request_s=3e-5"]`` -> checked values; a KvmoveError names the bad item."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        try:
            value = float(raw)
        except ValueError:
            raise KvmoveError(f"--cost {item!r} is not NAME=NUMBER (names: {', '.join(SPECS)})") from None
        if not sep:
            raise KvmoveError(f"--cost {item!r} is not NAME=NUMBER (names: {', '.join(SPECS)})")
        check_value(key.strip(), value)
        out[key.strip()] = value
    return out


def load_cost_file(path: Path) -> dict[str, float]:
    """A JSON object of cost name -> number (or -> {"value": number}); every value checked."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise KvmoveError(f"no such costs file: {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise KvmoveError(f"cannot read costs file {path} as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise KvmoveError(f"costs file {path} must hold a JSON object of name -> value")
    out: dict[str, float] = {}
    for name, item in raw.items():
        value = item.get("value") if isinstance(item, dict) else item
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise KvmoveError(f"costs file {path}: {name} must be a number, got {value!r}")
        check_value(name, float(value))
        out[name] = float(value)
    return out


def replace_cost(book: CostBook, cost: Cost) -> CostBook:
    """``book`` with one cost replaced (provenance kept as given)."""
    return replace(book, costs={**book.costs, cost.name: cost})
