"""The ``kvmove`` weight-transfer backend inside one live vLLM, driven through vLLM's own four calls.

A stand-in puller hands the backend chosen checkpoint tensors (what an in-process puller may do), so these tests
check the backend itself: partial and empty updates, validation before anything changes, an update failing half
way (the engine refuses requests until it is retried), the prefix cache after an update, the read-back
``--verify`` uses, and ``shutdown``. One in-process vLLM (Qwen2 tiny: fused qkv and gate_up, biases, tied
embeddings, oneDNN-packed linears on CPU) serves them all. Needs vLLM (``make test-vllm``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

MODEL = "qwen2-vllm"
SEED = 3
PROMPTS = [[3, 17, 42, 7, 99, 5], [200, 1, 150, 60, 61, 62, 63, 64]]
LONG_PROMPT = [(7 * i + 3) % 250 + 3 for i in range(140)]  # longer than one CPU KV block (128 tokens)


def _vllm_or_skip() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("KVMOVE_REQUIRE_VLLM") == "1":
            pytest.fail("KVMOVE_REQUIRE_VLLM=1 but vLLM is not installed (make test-vllm installs it)")
        pytest.skip("vLLM is not installed (make test-vllm runs these tests)")


@dataclass
class RegionPuller:
    """Hands the backend ``pending`` HF tensors, as an in-process puller may (the backend lands them)."""

    session: Any
    pending: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, info: dict[str, Any]) -> Any:
        from kvmove.vllm.session import Received

        payload, self.pending = self.pending, {}
        return Received(stats=None, tensors=frozenset(payload), payload=payload)


@dataclass
class Engine:
    llm: Any
    session: Any
    puller: RegionPuller
    cfg: Any
    weights: dict[str, torch.Tensor]
    """The checkpoint the live model should hold now."""

    def state(self) -> dict[str, torch.Tensor]:
        from kvmove.vllm.verify import computed_state

        return computed_state(self.session.live)

    def expected(self) -> dict[str, torch.Tensor]:
        """What vLLM's own loader and processing make of ``weights`` on a fresh model."""
        from kvmove.vllm.verify import computed_state

        return computed_state(self.session.reference(self.weights.items()))

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        import vllm

        params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def update(self, tensors: dict[str, torch.Tensor]) -> None:
        """vLLM's documented update: start, update_weights (our puller), finish."""
        self.llm.start_weight_update()
        self.puller.pending = dict(tensors)
        self.llm.update_weights({"update_info": {"sync_id": 1, "strategy": "v2"}})
        self.llm.finish_weight_update()
        self.weights |= tensors

    def attach(self) -> None:
        from kvmove.vllm.session import open_session

        self.session = open_session()
        self.llm.init_weight_transfer_engine({"init_info": {"session": self.session.key}})
        self.session.puller = self.puller = RegionPuller(self.session)


def _checkpoint(cfg: Any, version: int) -> dict[str, torch.Tensor]:
    from kvmove.models.weights import seeded_checkpoint

    return seeded_checkpoint(cfg, SEED, version)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    _vllm_or_skip()
    from kvmove.models import resolve_model
    from kvmove.models.directory import write_model_dir
    from kvmove.vllm.actor import start_llm

    cfg = resolve_model(MODEL)
    with tempfile.TemporaryDirectory(prefix="kvmove-vllm-test-") as tmp:
        weights = _checkpoint(cfg, 0)
        llm = start_llm(
            cfg, write_model_dir(cfg, Path(tmp), weights), load_format="auto", transfer=True, in_process=True
        )
        eng = Engine(llm, None, None, cfg, dict(weights))  # type: ignore[arg-type]
        eng.attach()
        yield eng


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    from kvmove.vllm.verify import mismatches

    return set(mismatches(after, before))


def test_an_empty_update_changes_nothing(engine: Engine) -> None:
    before, outputs = engine.state(), engine.generate(PROMPTS)
    engine.update({})
    assert not _changed(before, engine.state()), "start + finish with nothing received must leave the model as is"
    assert engine.generate(PROMPTS) == outputs


def test_a_one_tensor_update_changes_that_tensor_only(engine: Engine) -> None:
    # q_proj is one third of the fused qkv_proj: k and v must keep their values
    name = "model.layers.1.self_attn.q_proj.weight"
    before = engine.state()
    engine.update({name: _checkpoint(engine.cfg, 1)[name]})
    after = engine.state()
    fused = "model.layers.1.self_attn.qkv_proj"
    assert _changed(before, after) == {f"{fused}:computed"} | ({f"{fused}.weight"} & before.keys())
    assert not _changed(engine.expected(), after), "the live model differs from vLLM's loader on the new checkpoint"


def test_an_update_that_is_not_whole_and_well_formed_is_refused_before_anything_changes(engine: Engine) -> None:
    before, outputs = engine.state(), engine.generate(PROMPTS)
    new = _checkpoint(engine.cfg, 5)
    q = "model.layers.2.self_attn.q_proj.weight"
    bad = {
        "a name no parameter reads": {"model.layers.0.mlp.nope.weight": new[q]},
        "a wrong shape": {q: new[q][:, :64].contiguous()},
        "a wrong dtype": {q: new[q].float()},
    }
    for why, tensors in bad.items():
        engine.llm.start_weight_update()
        engine.puller.pending = dict(new) | tensors if why == "a wrong shape" else dict(tensors)
        with pytest.raises(Exception, match="the update was refused, nothing changed"):
            engine.llm.update_weights({"update_info": {"sync_id": 5, "strategy": "v2"}})
        assert not _changed(before, engine.state()), f"{why}: the live model changed"
    assert engine.generate(PROMPTS) == outputs, "a refused update leaves the engine serving as before"


def test_an_update_failing_half_way_is_refused_until_retried_to_completion(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    original = UnquantizedLinearMethod.process_weights_after_loading
    calls = []

    def failing(self: Any, layer: Any) -> None:
        calls.append(layer)
        if len(calls) == 5:  # the fifth linear module, half way through the model
            raise RuntimeError("injected post-processing failure")
        original(self, layer)

    before, outputs = engine.state(), engine.generate(PROMPTS)
    new = _checkpoint(engine.cfg, 2)
    engine.llm.start_weight_update()
    engine.puller.pending = dict(new)
    monkeypatch.setattr(UnquantizedLinearMethod, "process_weights_after_loading", failing)
    with pytest.raises(Exception, match=r"update torn.*injected post-processing failure"):
        engine.llm.update_weights({"update_info": {"sync_id": 2, "strategy": "v2"}})
    monkeypatch.undo()
    assert _changed(before, engine.state()), "units before the failure were committed (the update is torn)"
    with pytest.raises(RuntimeError, match="refuses requests until that update is retried"):
        engine.generate(PROMPTS)
    engine.llm.start_weight_update()
    with pytest.raises(RuntimeError, match=r"update torn.*did not complete"):
        engine.llm.finish_weight_update()  # finishing a torn update without retrying it is refused too
    with pytest.raises(RuntimeError, match="refuses requests"):
        engine.generate(PROMPTS)
    engine.puller.pending = dict(new)  # the same update (still active in vLLM), retried to completion
    engine.llm.update_weights({"update_info": {"sync_id": 2, "strategy": "v2"}})
    engine.llm.finish_weight_update()
    engine.weights |= new
    assert not _changed(engine.expected(), engine.state())
    assert engine.generate(PROMPTS) != outputs


def test_no_stale_prefix_cache_after_an_update(engine: Engine) -> None:
    old = engine.generate([LONG_PROMPT])  # fills (and caches) at least one full KV block of this prompt
    engine.update(_checkpoint(engine.cfg, 3))
    got = engine.generate([LONG_PROMPT])
    engine.llm.reset_prefix_cache()
    fresh = engine.generate([LONG_PROMPT])
    assert fresh != old, "new weights: the greedy continuation must change"
    assert got == fresh, "the update served KV computed with the old weights"


def test_verify_reads_back_what_linear_kernels_compute_with(engine: Engine) -> None:
    import torch.nn.functional as F

    from kvmove.vllm.verify import computed_state, mismatches

    name, module = "model.layers.0.mlp.down_proj", engine.session.live.model.layers[0].mlp.down_proj
    wrong = _checkpoint(engine.cfg, 9)[name + ".weight"]
    assert not mismatches(engine.state(), engine.expected())
    # where vLLM packs CPU linears (oneDNN, sgl-kernel) the parameter is 0 elements and the kernel closure
    # holds the weight: a wrong packed copy is invisible to the parameters, but not to the read-back
    kernel = module.cpu_linear
    module.cpu_linear = lambda x, weight, bias: F.linear(x, wrong, bias)
    try:
        assert mismatches(engine.state(), engine.expected()) == [name + ":computed"]
    finally:
        module.cpu_linear = kernel
    # and a reference of another checkpoint is told apart on exactly that module
    other = engine.weights | {name + ".weight": wrong}
    bad = mismatches(engine.state(), computed_state(engine.session.reference(other.items())))
    assert set(bad) == {name + ":computed"} | ({name + ".weight"} & engine.state().keys())


def test_shutdown_releases_the_session_and_misuse_is_a_runtime_error(engine: Engine) -> None:
    import gc
    import weakref

    from kvmove.vllm.session import SESSIONS

    key, window = engine.session.key, weakref.ref(engine.session.stager.stager.window.buffer)
    engine.llm.shutdown_weight_transfer_engine()
    engine.session = engine.puller = None  # type: ignore[assignment]
    gc.collect()
    assert key not in SESSIONS, "shutdown must prune the session table"
    assert window() is None, "shutdown must release the staging window"
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine"):
        engine.llm.start_weight_update()
    with pytest.raises(RuntimeError, match="no kvmove session 'nope'"):
        engine.llm.init_weight_transfer_engine({"init_info": {"session": "nope"}})
    engine.attach()  # a new session on the same engine: a part of a fused parameter is rebuilt from the live model
    one = "model.layers.0.self_attn.k_proj.weight"
    engine.update({one: _checkpoint(engine.cfg, 4)[one]})
    assert not _changed(engine.expected(), engine.state())
