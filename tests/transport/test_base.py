"""Registry, range checks and missing-dependency messages: no processes needed."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.transport import AUTO_ORDER, TRANSPORTS, available_transports, get_transport
from kvmove.transport.base import BufferDesc, TransportError, check_ranges, coalesce
from kvmove.transport.nixl import NixlTransport
from kvmove.transport.rdt import RdtNixlTransport

REMOTE = BufferDesc("nixl", "server", 0, 100)
LOCAL = BufferDesc("nixl", "client", 0, 50)


def test_registry_names():
    assert set(TRANSPORTS) == {
        *("nixl", "rdt-nixl", "rdt-gloo", "gloo", "object-store", "nccl", "cuda-ipc", "shm", "http")
    }
    assert all(TRANSPORTS[n].name == n for n in TRANSPORTS)


def test_unknown_transport_is_a_clear_error():
    with pytest.raises(KvmoveError, match=r"unknown transport 'carrier-pigeon'.*known: auto, nixl"):
        get_transport("carrier-pigeon")


def test_auto_picks_the_first_available_in_order():
    first = next(n for n in AUTO_ORDER if n in available_transports())
    assert get_transport("auto").name == first


def test_auto_never_picks_http(monkeypatch):
    """http is the KV servers' fallback (kvmove.migration.endpoint), not a weight-sync transport."""
    assert "http" not in AUTO_ORDER
    for name in AUTO_ORDER:
        monkeypatch.setattr(TRANSPORTS[name], "is_available", classmethod(lambda cls: False))
    with pytest.raises(KvmoveError, match="no transport is available"):
        get_transport("auto")


@pytest.mark.parametrize(
    ("ranges", "side"),
    [([(95, 0, 10)], "remote"), ([(0, 45, 10)], "local"), ([(0, 0, 10), (0, 49, 2)], "local")],
)
def test_range_out_of_bounds(ranges, side):
    with pytest.raises(TransportError, match=f"past the .*{side} buffer"):
        check_ranges(REMOTE, LOCAL, ranges)


def test_negative_range():
    with pytest.raises(TransportError, match="non-negative"):
        check_ranges(REMOTE, LOCAL, [(-1, 0, 4)])


def test_empty_ranges_are_dropped():
    assert check_ranges(REMOTE, LOCAL, [(3, 4, 0)]).shape == (0, 3)
    assert check_ranges(REMOTE, LOCAL, []).shape == (0, 3)


@pytest.mark.parametrize(
    ("spans", "merged"),
    [
        ([(0, 0, 4), (4, 4, 4)], [(0, 0, 8)]),
        ([(0, 0, 4), (4, 8, 4)], [(0, 0, 4), (4, 8, 4)]),
        ([(0, 0, 4), (4, 4, 4), (20, 8, 2), (22, 10, 1)], [(0, 0, 8), (20, 8, 3)]),
        ([(8, 0, 4), (0, 4, 4)], [(8, 0, 4), (0, 4, 4)]),
    ],
)
def test_coalesce(spans, merged):
    assert coalesce(np.array(spans, dtype=np.int64)).tolist() == [list(m) for m in merged]


@pytest.mark.parametrize("cls", [NixlTransport, RdtNixlTransport])
def test_missing_nixl_names_the_extra(monkeypatch, cls):
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # makes `import nixl._api` raise ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'kvmove\[nixl\]'"):
        cls()
    assert "nixl" not in available_transports()
    assert "rdt-nixl" not in available_transports()


def test_missing_ray_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependencyError, match="pip install ray"):
        get_transport("object-store")()
    without_ray = ("nixl", "gloo", "nccl", "cuda-ipc", "shm", "http")
    assert available_transports() == [n for n in without_ray if n in available_transports()]
    assert "shm" in available_transports()  # plain torch: available wherever kvmove runs


def test_available_transports_never_raises(monkeypatch):
    def boom(*_a, **_k):
        raise RuntimeError("broken install")

    monkeypatch.setattr("importlib.import_module", boom)
    assert isinstance(available_transports(), list)
