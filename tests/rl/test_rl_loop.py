"""The RL loop end to end (needs vLLM: ``make test-vllm`` runs it): 2 FSDP2 trainer processes, each with kvmove's
trainer engine of vLLM's weight-transfer API, and 2 live vLLM ``LLM`` engines (default multi-process mode), 2
steps; every sync verified in the workers against the trainer's checkpoint, the engines' log-probabilities of
their samples matching the trainer's on the synced weights, and the greedy generations following the trained
weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvmove.rl.loop import RlConfig, run_rl


def _vllm_or_skip() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("KVMOVE_REQUIRE_VLLM") == "1":
            pytest.fail("KVMOVE_REQUIRE_VLLM=1 but vLLM is not installed (make test-vllm installs it)")
        pytest.skip("vLLM is not installed (make test-vllm runs this test)")


def test_two_rl_steps_train_sync_verify_and_change_the_generations(tmp_path: Path) -> None:
    _vllm_or_skip()
    pytest.importorskip("transformers", reason="the FSDP2 policy is a transformers model (kvmove[train])")
    # 4 prompts x 4 samples: groups whose samples differ in reward (the advantages are not all 0), so the step trains
    config = RlConfig(steps=2, max_tokens=6, lr=1e-2, launcher="processes", work_dir=str(tmp_path))
    steps = list(run_rl(config))
    assert [s.step for s in steps] == [1, 2]
    for s in steps:
        assert s.sync.verified is True and s.sync.live_engines == 2, (s.step, s.sync.mismatches)
        assert s.sync.strategy == "v3" and s.sync.bytes > 0 and s.sync.version == s.step
        assert s.sync.weight_versions == (str(s.step), str(s.step))  # vLLM's finish_weight_update(version)
        assert 0.0 <= s.reward <= 1.0 and len(s.greedy_tokens) == 4 and all(len(g) == 6 for g in s.greedy_tokens)
    assert steps[0].loss is None and steps[1].loss is not None and steps[1].loss != 0.0
    # the trainer scores the engines' samples with the weights the engines were synced to: same distribution
    assert steps[1].logprob_gap is not None and steps[1].logprob_gap < 0.1, steps[1].logprob_gap
    assert steps[0].greedy_tokens != steps[1].greedy_tokens, "a trained step must change what the engines generate"
    assert (tmp_path / "checkpoints" / "step-2").is_dir()


def test_an_fp8_model_is_refused_before_anything_starts() -> None:
    """The loop's engines are vLLM, which serves no block-FP8 weights here (docs/notes/fp8.md, "vLLM")."""
    from kvmove.errors import KvmoveError
    from kvmove.rl.loop import check

    with pytest.raises(KvmoveError, match="--engine-kind vllm does not serve fp8 weights"):
        check(RlConfig(model="qwen3-moe-fp8-tiny"))
    check(RlConfig())  # the default (BF16) model passes
