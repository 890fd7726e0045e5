"""What a server holds of its host: memory it will need (checked before anything is allocated) and what its
process holds now (open file descriptors, resident memory, threads), for ``/kvmove/resources`` and the soak."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from kvmove.errors import KvmoveError
from kvmove.kvcache import KVGeometry
from kvmove.memory import available_memory
from kvmove.models import resolve_model
from kvmove.server.config import ServerConfig


class ProcessResources(NamedTuple):
    """``fds`` and ``rss_bytes`` are -1 where ``/proc`` is not available (not Linux); ``threads`` counts the
    process's OS threads (``/proc/self/task``: those of torch, NIXL/UCX and the C libraries too), where ``/proc``
    is not available Python's own."""

    fds: int
    rss_bytes: int
    threads: int


def process_resources() -> ProcessResources:
    try:
        fds = len(os.listdir("/proc/self/fd"))
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        fds = rss = -1
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = threading.active_count()
    return ProcessResources(fds, rss, threads)


def kv_geometry(model: str, page_size: int, dtype: str) -> KVGeometry:
    cfg = resolve_model(model)
    return KVGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, page_size, getattr(torch, dtype))


def check_kv_memory(model: str, page_size: int, dtype: str, pages: dict[str, int]) -> int:
    """Bytes of the KV pools ``pages`` asks for (pool name -> pages); KvmoveError naming each pool's size if they
    do not fit in the memory this host has available, before any of it is allocated."""
    geometry = kv_geometry(model, page_size, dtype)
    per_page = geometry.page_bytes * geometry.num_buffers
    sizes = {name: n * per_page for name, n in pages.items()}
    total, available = sum(sizes.values()), available_memory()
    if available is not None and total > available:
        parts = ", ".join(f"{name} {n} pages = {_gib(sizes[name])}" for name, n in pages.items())
        raise KvmoveError(
            f"the KV pools need {_gib(total)} ({parts}; {_gib(per_page)} a page of {model}) but this host has "
            f"{_gib(available)} available: lower --num-pages/--host-pages"
        )
    return total


def check_server_memory(config: ServerConfig) -> int:
    """``check_kv_memory`` for the pools of one server: the device pool, and with migration the inbox and outbox."""
    pools = {"device pool": config.num_pages}
    if config.enable_kv_migration:
        pools |= {"host pool": config.num_host_pages, "outbox": config.num_host_pages}
    return check_kv_memory(config.model, config.page_size, config.dtype, pools)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB" if n >= 1 << 20 else f"{n} bytes"
