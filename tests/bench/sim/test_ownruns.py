"""Our own held-out one-GPU runs: costs from the training slice of the target's GPU, its other slices predicted."""

from __future__ import annotations

from kvmove.bench.results import Labels, Row, append_rows, load_results
from kvmove.bench.sim.ownruns import held_out_runs, one_gpu_book


def _row(layers: int, seconds: float) -> Row:
    return Row(kind="measured", suite="gpu", name="sync v3", model="qwen3-235b-a22b",
               trainer="tp=1,pp=1,ep=1,etp=1,dp=1", engine="tp=1,dp=1,ep=1,pp=1 x1", strategy="v3",
               transport="cuda-ipc", bytes=10**10, seconds=seconds, phases={"transfer": seconds - 0.001},
               extra={"sync": 2, "verified": True, "direct": True, "engine_dtype": "bf16",
                      "trainer_devices": ["cuda:0"], "engine_devices": ["cuda:0"], "transfer_gbps": 1000.0,
                      "model_overrides": {"num_hidden_layers": layers}})  # fmt: skip


def test_another_gpus_rows_set_no_one_gpu_cost_and_are_not_held_out(tmp_path) -> None:
    """An H100's newer matrix does not replace the H200 rows the target's held-out runs are predicted from."""
    append_rows(tmp_path, "gpu", [_row(2, 0.0070), _row(8, 0.0240)], Labels("gpu:H200 x1", {}, "old"))
    append_rows(tmp_path, "gpu", [_row(2, 0.0100), _row(8, 0.0300)], Labels("gpu:H100 80GB HBM3 x1", {}, "new"))
    rows = load_results(tmp_path)
    book = one_gpu_book(rows)
    fixed = book.costs["sync_s"]
    assert [r.commit for r in fixed.rows] == ["old"] and abs(fixed.value - 0.001) < 1e-12
    (run,) = held_out_runs(rows)
    assert run.measured == 0.0240 and {r.commit for r in run.rows} == {"old"}
