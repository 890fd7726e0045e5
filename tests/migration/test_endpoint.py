"""Which transport a server's KV data plane uses: ``auto`` prefers NIXL and falls back to http, saying so."""

from __future__ import annotations

import pytest

from kvmove.errors import KvmoveError, MissingDependencyError
from kvmove.migration.endpoint import FALLBACK_NOTE, choose_transport
from kvmove.transport import HttpTransport, NixlTransport


def _without_nixl(monkeypatch) -> None:
    monkeypatch.setattr(NixlTransport, "is_available", classmethod(lambda cls: False))


def test_auto_prefers_nixl_where_it_imports(monkeypatch) -> None:
    monkeypatch.setattr(NixlTransport, "is_available", classmethod(lambda cls: True))
    choice = choose_transport("auto")
    assert (choice.name, choice.requested, choice.fallback) == ("nixl", "auto", False)


def test_auto_falls_back_to_http_with_a_note(monkeypatch) -> None:
    _without_nixl(monkeypatch)
    choice = choose_transport("auto")
    assert (choice.name, choice.note, choice.fallback) == ("http", FALLBACK_NOTE, True)
    assert "NIXL is not installed" in choice.note and "slower fallback" in choice.note


def test_named_transports_are_used_as_asked(monkeypatch) -> None:
    if HttpTransport.is_available():
        assert choose_transport("http") == ("http", "http", "")
    _without_nixl(monkeypatch)
    with pytest.raises(MissingDependencyError, match=r"pip install 'kvmove\[nixl\]' \(or --transport http"):
        choose_transport("nixl")


@pytest.mark.parametrize("name", ["gloo", "object-store", "carrier-pigeon"])
def test_transports_that_cannot_serve_kv_are_refused(name: str) -> None:
    with pytest.raises(KvmoveError, match=r"cannot move KV between servers \(use one of: auto, nixl, http\)"):
        choose_transport(name)
