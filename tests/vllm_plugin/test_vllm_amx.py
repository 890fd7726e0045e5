"""kvmove's vLLM entry point asks for AMX tile state where the CPU has AMX (kvmove.vllm.allow_amx_tiles): vLLM's
CPU attention uses AMX tiles without asking, and its worker died of SIGILL on an AMX host. No vLLM needed."""

from __future__ import annotations

import pytest
import torch

from kvmove.vllm import allow_amx_tiles


@pytest.mark.parametrize(("has_tiles", "granted"), [(False, False), (True, True), (True, False)])
def test_tile_state_is_asked_for_only_where_the_cpu_has_tiles(
    has_tiles: bool, granted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[bool] = []

    def init() -> bool:
        asked.append(True)
        return granted

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_tiles)
    monkeypatch.setattr(torch.cpu, "_init_amx", init)
    assert allow_amx_tiles() is (has_tiles and granted)
    assert asked == ([True] if has_tiles else [])


def test_this_hosts_answer_is_a_bool_and_a_bf16_matmul_still_runs() -> None:
    allowed = allow_amx_tiles()
    assert isinstance(allowed, bool)
    a = torch.ones(64, 64, dtype=torch.bfloat16)
    assert float((a @ a)[0, 0]) == 64.0
