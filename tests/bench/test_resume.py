"""Time to resume vs re-prefill (``kvmove.bench.resume``): the CPU twin of the GPU suite runs the same code with a
small model, and a ``gpu`` test runs it on cuda with Qwen3-235B-A22B's attention shape (two layers)."""

from __future__ import annotations

import pytest
import torch

from kvmove.bench.results import Row, append_rows, load_results
from kvmove.bench.resume import ResumeConfig, crossover, prefill_flops, run
from kvmove.models import resolve_model


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _check(rows: list[Row], lens: tuple[int, ...]) -> None:
    assert [r.extra["prompt_tokens"] for r in rows] == list(lens)
    for r in rows:
        e = r.extra
        assert r.kind == "measured" and r.suite == "resume"
        assert e["same_first_token"] and e["kv_bit_exact"], "the migrated K/V continues as re-prefill does"
        assert set(r.phases) == {"d2h", "transfer", "h2d", "insert", "first_decode", "reprefill"}
        assert all(v > 0 for v in r.phases.values())
        assert r.seconds == pytest.approx(e["resume_s"]) and e["speedup"] == pytest.approx(e["reprefill_s"] / r.seconds)
        assert set(e["modeled_resume_s_by_link"]) == {"25GBps", "50GBps"}
    geo_bytes = [r.bytes / r.extra["prompt_tokens"] for r in rows]
    assert len(set(geo_bytes)) == 1, "K/V bytes moved grow with the prompt, page for page"


def test_cpu_twin_resumes_from_migrated_kv_and_writes_rows(tmp_path) -> None:
    lens = (16, 64)
    cfg = ResumeConfig(model="qwen3-moe-tiny", layers=2, prompt_lens=lens, repeats=1, device="cpu", dtype="float32")
    rows = run(cfg, record=lambda new: append_rows(tmp_path, "resume", new))
    df = load_results(tmp_path)
    assert list(df["suite"]) == ["resume", "resume"] and set(df["kind"]) == {"measured"}
    _check(rows, lens)


def test_crossover_is_the_shortest_prompt_from_which_migration_always_wins() -> None:
    def row(p: int, wins: bool) -> Row:
        return Row("measured", "resume", "r", extra={"prompt_tokens": p, "migration_wins": wins})

    assert crossover([row(64, False), row(256, True), row(128, False), row(512, True)]) == 256
    assert crossover([row(64, True), row(128, True)]) == 64
    assert crossover([row(64, True), row(128, False)]) is None


def test_prefill_flops_of_the_published_shape() -> None:
    cfg = resolve_model("qwen3-235b-a22b")
    per_token = prefill_flops(cfg, 1) / 2
    assert 20e9 < per_token < 24e9, "about the 22B active parameters per token"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_resume_of_qwen3_235b_attention_shape() -> None:
    lens = (512, 2048)
    rows = run(ResumeConfig(layers=2, prompt_lens=lens, repeats=1))
    _check(rows, lens)


def test_gpu_suite_without_a_gpu_is_one_line(monkeypatch, capsys) -> None:
    import sys

    from kvmove.cli.main import main as cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["kvmove", "bench", "run", "--suite", "migration-gpu"])
    with pytest.raises(SystemExit) as exit_:
        cli()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "needs a CUDA GPU" in err and len(err.splitlines()) == 1


def test_the_gpu_suite_imports_without_the_server_stack() -> None:
    """The GPU machine has plain torch: no pydantic, FastAPI, uvicorn, Ray or NIXL."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('pydantic', 'fastapi', 'uvicorn', 'starlette', 'ray', 'nixl'): sys.modules[m] = None\n"
        "import kvmove.bench.resume\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
