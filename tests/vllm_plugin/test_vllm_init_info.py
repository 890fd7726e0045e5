"""The ``kvmove`` backend parses init_info as vLLM's own weight-transfer engines do: what cannot start an engine is
a ValueError ("Invalid init_info ...") at parse time, not a later error from the worker. Needs vLLM
(``make test-vllm``); without it the test skips, unless KVMOVE_REQUIRE_VLLM=1."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    try:
        from kvmove.vllm.transfer import KvmoveTransferEngine
    except ImportError:
        if os.environ.get("KVMOVE_REQUIRE_VLLM") == "1":
            pytest.fail("KVMOVE_REQUIRE_VLLM=1 but vLLM is not installed (make test-vllm installs it)")
        pytest.skip("vLLM is not installed (make test-vllm runs these tests)")
    return object.__new__(KvmoveTransferEngine)  # parse_init_info reads no engine state


def test_an_empty_init_info_is_refused_as_vllm_refuses_it(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"^Invalid init_info for KvmoveTransferEngine: .*neither a trainer registry"):
        engine.parse_init_info({})
    with pytest.raises(ValueError, match=r"^Invalid init_info for KvmoveTransferEngine: .*unexpected keyword"):
        engine.parse_init_info({"session": "s", "bogus": 1})


def test_a_registry_or_a_session_is_accepted(engine) -> None:  # type: ignore[no-untyped-def]
    info = engine.parse_init_info({"registry_host": "127.0.0.1", "registry_port": 4000, "authkey": "ab"})
    assert (info.registry_host, info.registry_port, info.transport) == ("127.0.0.1", 4000, "nixl")
    assert engine.parse_init_info({"session": "k"}).session == "k"
