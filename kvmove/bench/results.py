"""The results store: one row schema for every benchmark, parquet files under ``results/``.

Every row says whether it was measured or simulated, on what hardware, with which versions and git commit.
Each suite appends to its own file (``results/<suite>.parquet``); readers tolerate columns they do not know.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvmove.errors import KvmoveError

COLUMNS = (
    "timestamp",
    "kind",
    "suite",
    "name",
    "hardware",
    "versions",
    "git_commit",
    "model",
    "trainer",
    "engine",
    "strategy",
    "transport",
    "bytes",
    "seconds",
    "gbps",
    "phases",
    "peak_memory_bytes",
    "link_limit_gbps",
    "extra",
)


@dataclass(frozen=True)
class Row:
    """One benchmark result. ``kind`` is "measured" or "simulated"; dict fields are stored as JSON text."""

    kind: str
    suite: str
    name: str
    model: str = ""
    trainer: str = ""
    engine: str = ""
    strategy: str = ""
    transport: str = ""
    bytes: int = 0
    seconds: float = 0.0
    gbps: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    peak_memory_bytes: int = 0
    link_limit_gbps: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Labels:
    """Where and with what a row was produced."""

    hardware: str
    versions: dict[str, str]
    git_commit: str

    @classmethod
    def here(cls) -> Labels:
        return cls(hardware_label(), versions(), git_commit())


def hardware_label(device: str = "cpu") -> str:
    """``gpu:H200 x2`` (the first GPU's name, how many there are) for a CUDA device, else ``cpu:<model> x<cores>``."""
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(0).removeprefix("NVIDIA ")
        return f"gpu:{name} x{torch.cuda.device_count()}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu:{cpu} x{os.cpu_count()}"


def link_conditions() -> dict[str, str]:
    """What this host does to loopback links that a row cannot see otherwise: UCX's transport selection and TCP port
    range where set (``UCX_TLS``, ``UCX_TCP_PORT_RANGE``), and the shaping classes ``tc`` puts on ``lo`` (rates and
    qdiscs, one line each; docs/delta-sync.md shapes NIXL's loopback traffic to a stated rate). Empty where there
    is none (no ``tc``, no qdisc but the default)."""
    out = {k.lower(): os.environ[k] for k in ("UCX_TLS", "UCX_TCP_PORT_RANGE") if os.environ.get(k)}
    shaping = [ln for kind in ("qdisc", "class") for ln in _tc_lines(kind) if "noqueue" not in ln]
    if shaping:
        out["loopback_shaping"] = "; ".join(shaping)
    return out


def _tc_lines(kind: str) -> list[str]:
    try:
        done = subprocess.run(["tc", kind, "show", "dev", "lo"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return []
    return [" ".join(ln.split()) for ln in done.stdout.splitlines() if ln.strip()] if done.returncode == 0 else []


def versions() -> dict[str, str]:
    import torch

    import kvmove

    out = {"kvmove": kvmove.__version__, "python": platform.python_version(), "torch": torch.__version__}
    for name in ("ray", "nixl", "vllm"):
        try:
            module = __import__(name)
            out[name] = str(getattr(module, "__version__", "?"))
        except Exception:
            continue
    return out


def git_commit() -> str:
    """The short commit of this checkout, ``-dirty`` when tracked code differs from it (``KVMOVE_GIT_COMMIT``
    where the tree travelled without .git). Result files (``*.parquet``) are data, not code: rows appended by
    an earlier run of a sweep do not make the next run's rows dirty."""
    if os.environ.get("KVMOVE_GIT_COMMIT"):
        return os.environ["KVMOVE_GIT_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True, cwd=here
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude,glob)**/*.parquet"],
            capture_output=True,
            text=True,
            cwd=here.parent.parent,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def require_traceable(commit: str) -> str:
    """``commit`` if rows labelled with it can be traced to code, else a KvmoveError: a ``-dirty`` commit names a
    tree whose tracked code differed from the commit, so no checkout reproduces what its rows measured."""
    if commit.endswith("-dirty"):
        raise KvmoveError(
            f"refusing to record rows from a dirty tree ({commit}: tracked files differ from the commit, so the rows "
            "could not be traced to code); commit or stash the changes first"
        )
    return commit


def to_record(row: Row, labels: Labels) -> dict[str, Any]:
    """The parquet record of ``row``; refuses labels whose commit is not traceable (see require_traceable)."""
    require_traceable(labels.git_commit)
    rec = asdict(row)
    rec.update(timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), hardware=labels.hardware)
    rec.update(versions=json.dumps(labels.versions, sort_keys=True), git_commit=labels.git_commit)
    rec["phases"] = json.dumps(row.phases, sort_keys=True)
    rec["extra"] = json.dumps(row.extra, sort_keys=True, default=str)
    if row.kind not in ("measured", "simulated"):
        raise KvmoveError(f"result row kind must be measured or simulated, not {row.kind!r}")
    return {c: rec[c] for c in COLUMNS}


def json_dict(value: Any) -> dict[str, Any]:
    """A row's ``phases`` or ``extra`` as stored (JSON text) or as built (a dict), as a dict; {} when it is
    neither."""
    if isinstance(value, dict):
        return value
    try:
        out = json.loads(value) if isinstance(value, str) else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def append_rows(results_dir: Path, suite: str, rows: list[Row], labels: Labels | None = None) -> Path:
    """Append rows to ``results_dir/<suite>.parquet`` (created if absent) and return its path."""
    labels = labels or Labels.here()
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{suite}.parquet"
    new = pd.DataFrame([to_record(r, labels) for r in rows], columns=list(COLUMNS))
    if path.exists():
        new = pd.concat([read_file(path), new], ignore_index=True)
    new.to_parquet(path, index=False)
    return path


def read_file(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as exc:
        raise KvmoveError(f"results file {path} is unreadable ({type(exc).__name__}: {exc})") from None


def load_results(results_dir: Path) -> pd.DataFrame:
    """All rows under ``results_dir``; unknown columns are kept, missing ones filled with NA."""
    files = sorted(results_dir.glob("*.parquet")) if results_dir.is_dir() else []
    if not files:
        raise KvmoveError(f"no results (*.parquet) under {results_dir}; run `kvmove bench run` first")
    frames = [read_file(f) for f in files]
    df = pd.concat(frames, ignore_index=True)
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = pd.NA
    return df
