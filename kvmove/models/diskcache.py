"""What transformers says about a config, kept on disk between runs: a config's tensor table (transformers' meta
model and checkpoint conversion, :mod:`kvmove.models.table`) and the shape-deciding defaults of its architecture
(:mod:`kvmove.models.config`).

Asking costs seconds that a plan does not (importing transformers, building a 1T-parameter model on the meta
device), and the answers only change with the config, transformers or kvmove's own model code. So each answer is
one JSON file in ``$KVMOVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvmove``, else ``~/.cache/kvmove``, named by a
hash of what it answers, the installed transformers' version and the source of ``kvmove/models``: any of them
changing names another file, so a stale answer is never read (safe to delete at any time; ``KVMOVE_NO_CACHE=1``
neither reads nor writes it). A file that does not hold its own key, or cannot be read, is rebuilt and
rewritten; a directory that cannot be written leaves the answer uncached. Checkpoint directories are never
cached: their headers are read each time.

The answers for the full-size presets (Qwen3-235B-A22B, Kimi K2) ship with kvmove as data
(``kvmove/models/configs/answers.json``, :data:`SHIPPED`), so even a first run of a full-size plan imports no
transformers: they are read where the disk cache has no answer (and never with ``KVMOVE_NO_CACHE=1``), and
``tests/models/test_diskcache.py`` checks each against transformers' answer of the installed version.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvmove.models.tensors import TensorMeta, TensorTable

T = TypeVar("T")

SHIPPED = "answers.json"
"""The shipped answers' file, beside the presets' configs in ``kvmove/models/configs``."""
CACHE_DIR_ENV = "KVMOVE_CACHE_DIR"
NO_CACHE_ENV = "KVMOVE_NO_CACHE"


def cache_dir() -> Path | None:
    """Where answers are kept; None where ``KVMOVE_NO_CACHE`` is set."""
    if os.environ.get(NO_CACHE_ENV, "") not in ("", "0"):
        return None
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvmove"


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of what the answers are derived with: the installed transformers and torch, and kvmove's model code
    (every ``kvmove/models/*.py``)."""
    digest = hashlib.sha256()
    for dist in ("transformers", "torch"):
        digest.update(f"{dist}={_version(dist)};".encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def entry_path(kind: str, key: Any) -> Path | None:
    """The file that holds the answer of ``kind`` for ``key`` (None where caching is off)."""
    root = cache_dir()
    if root is None:
        return None
    return root / f"{kind}-{hashlib.sha256(_key_text(kind, key).encode()).hexdigest()[:40]}.json"


def remembered(
    kind: str,
    key: Any,
    build: Callable[[], T],
    encode: Callable[[T], Any] = lambda v: v,
    decode: Callable[[Any], T] = lambda v: v,
) -> T:
    """The answer of ``kind`` for ``key`` (JSON-able): read from its file where that holds it, else ``build()``,
    stored as ``encode(answer)`` (JSON-able) and returned. What ``build`` raises is raised, and nothing is stored."""
    path = entry_path(kind, key)
    if path is None:
        return build()
    text = _key_text(kind, key)
    stored = _read(path, text)
    if stored is not None:
        try:
            return decode(stored)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            pass  # written by a codec of another shape: rebuilt below
    shipped = shipped_answers().get(shipped_key(kind, key))
    if shipped is not None:
        try:
            return decode(shipped)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            pass  # a file of another shape: built below
    answer = build()
    _write(path, {"key": text, "value": encode(answer)})
    return answer


def shipped_key(kind: str, key: Any) -> str:
    """How a shipped answer is named: what it answers, without the code version (a test vouches for the code)."""
    return json.dumps({"kind": kind, "key": key}, sort_keys=True, default=repr)


@lru_cache(maxsize=1)
def shipped_answers() -> dict[str, Any]:
    """The answers shipped with kvmove, by :func:`shipped_key` (empty where the file is absent or unreadable)."""
    try:
        data = json.loads(resources.files("kvmove.models").joinpath("configs", SHIPPED).read_text())
        return {str(a["key"]): a["value"] for a in data["answers"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _key_text(kind: str, key: Any) -> str:
    return json.dumps({"kind": kind, "code": code_version(), "key": key}, sort_keys=True, default=repr)


def _read(path: Path, key_text: str) -> Any:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key_text or "value" not in data:
        return None
    return data["value"]


def _write(path: Path, data: dict[str, Any]) -> None:
    """Written whole or not at all (a temporary file renamed over it), so concurrent runs never read half a file."""
    try:
        text = json.dumps(data)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    except (OSError, TypeError, ValueError):
        return  # not JSON-able, or no directory to write: the answer stays uncached
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def encode_table(table: TensorTable) -> dict[str, Any]:
    """A tensor table as JSON: tensors as ``[name, shape, dtype]``, templates in their order."""

    def metas(ts: tuple[TensorMeta, ...]) -> list[Any]:
        return [[t.name, list(t.shape), str(t.dtype).removeprefix("torch.")] for t in ts]

    templates = [[kind, first, metas(ts)] for kind, (first, ts) in table.templates.items()]
    return {"head": metas(table.head), "kinds": list(table.kinds), "templates": templates, "tail": metas(table.tail)}


def decode_table(data: dict[str, Any]) -> TensorTable:
    """The table :func:`encode_table` wrote (ValueError on a dtype torch lacks)."""

    def metas(rows: list[Any]) -> tuple[TensorMeta, ...]:
        return tuple(TensorMeta(str(n), tuple(int(s) for s in shape), _dtype(d)) for n, shape, d in rows)

    templates = {str(kind): (int(first), metas(ts)) for kind, first, ts in data["templates"]}
    return TensorTable(metas(data["head"]), tuple(data["kinds"]), templates, metas(data["tail"]))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no torch dtype {name}")
    return dtype
