"""The GPU suite (``kvmove bench run --suite gpu``) and its CPU twin: the same code on CPU devices, in a Python
where ray, fastapi, uvicorn and httpx cannot be imported (the GPU machine has none of them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvmove.bench.gpu import GpuSuite, gpu_suite
from kvmove.bench.results import load_results

BLOCKER = """
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not installed here (blocked by the test)")
        return None

sys.meta_path.insert(0, Absent())
"""
BLOCKED = ("ray", "fastapi", "uvicorn", "httpx", "starlette")

RUN_TWIN = """
from dataclasses import replace
from pathlib import Path
import sys
from kvmove.bench.gpu import GpuSuite, gpu_suite
from kvmove.bench.matrix import LAYOUTS
from kvmove.bench.results import append_rows

if __name__ == "__main__":
    out = Path(sys.argv[1])
    layouts = (LAYOUTS[0], LAYOUTS[3])  # 1->1 (disaggregated and colocated) and pp=2 -> tp=2 (colocated)
    suite = replace(GpuSuite.cpu_twin(), transports=("nixl", "nccl"), strategies="v3,broadcast", layouts=layouts)
    gpu_suite(suite, lambda rows: append_rows(out, "gpu", rows) if rows else None, print)
    print("imported:", sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2].split(","))))
"""


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _rows(results: Path) -> list[dict[str, object]]:
    rows = load_results(results).to_dict("records")
    for r in rows:
        r["extra"] = json.loads(str(r["extra"]))
    return rows


def _check(rows: list[dict[str, object]], transports: set[str], strategies: set[str], cells: int) -> None:
    ceilings = [r for r in rows if str(r["name"]).startswith("ceiling ")]
    syncs = [r for r in rows if str(r["name"]).startswith("sync")]
    kv = [r for r in rows if r["name"] == "kv migration copy"]
    assert any("device copy" in str(r["name"]) for r in ceilings)
    assert kv and all(r["extra"]["verified"] for r in kv)  # type: ignore[index]
    assert {r["transport"] for r in syncs if r["strategy"] != "broadcast"} == transports
    assert {r["strategy"] for r in syncs} == strategies
    per_cell = [r for r in ceilings if str(r["name"]).startswith("ceiling sync")]
    assert len(per_cell) == cells, [r["name"] for r in per_cell]
    for r in syncs:
        extra = r["extra"]
        assert extra["verified"] is True and extra["launcher"] == "processes", r  # type: ignore[index]
        ceiling = extra["ceiling_seconds"]  # type: ignore[index]
        assert ceiling > 0 and extra["fraction_of_ceiling"] == pytest.approx(ceiling / r["seconds"])  # type: ignore[index,operator]
        assert r["link_limit_gbps"] == pytest.approx(r["bytes"] / ceiling / 1e9)  # type: ignore[operator]
    for r in per_cell:  # the bytes that stay on a device at the device-copy rate, those crossing at the P2P rate
        e = r["extra"]
        want = e["local_max_bytes"] / (e["copy_gbps"] * 1e9)  # type: ignore[index,operator]
        if e["cross_max_bytes"]:  # type: ignore[index]
            want += e["cross_max_bytes"] / (e["p2p_gbps"] * 1e9)  # type: ignore[index,operator]
        assert r["seconds"] == pytest.approx(want)


def test_cpu_twin_runs_the_gpu_suite_without_ray_or_web_packages(tmp_path: Path) -> None:
    from kvmove.transport import available_transports

    transports = {t for t in ("nixl", "nccl") if t in available_transports()}
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(BLOCKED)))
    script = tmp_path / "twin.py"
    script.write_text(RUN_TWIN)
    env = os.environ | {"PYTHONPATH": str(site)}
    cmd = [sys.executable, str(script), str(tmp_path / "results"), ",".join(BLOCKED)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported: []" in done.stdout
    # cells: 1->1 disaggregated x each transport, 1->1 and pp=2 -> tp=2 colocated x each transport (CPU ranks share)
    _check(_rows(tmp_path / "results"), transports, {"v3", "broadcast"}, cells=3 * len(transports))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_gpu_suite_matrix_on_this_machines_gpus(tmp_path: Path) -> None:
    import torch

    from kvmove.bench.matrix import LAYOUTS
    from kvmove.bench.results import append_rows

    gpus = min(torch.cuda.device_count(), 2)
    transports = ("cuda-ipc", "nccl") if gpus > 1 else ("cuda-ipc",)
    suite = replace(
        GpuSuite(),
        layers=2,  # pp=2 needs a layer per stage
        syncs=2,
        transports=transports,
        strategies="v2,v3,broadcast",
        layouts=(LAYOUTS[0], LAYOUTS[3]),
        devices=tuple(f"cuda:{i}" for i in range(gpus)),
        prompt_lens=(1024,),
        ceiling_bytes=256 << 20,
    )
    gpu_suite(suite, lambda rows: append_rows(tmp_path, "gpu", rows) if rows else None, print)
    strategies = {"v2", "v3", "broadcast"} if gpus > 1 else {"v2", "v3"}
    cells = 2 + len(transports) if gpus > 1 else 2  # colocated cells run cuda-ipc only (NCCL cannot share a GPU)
    rows = _rows(tmp_path)
    _check(rows, set(transports), strategies, cells)
    v3 = [r for r in rows if r["transport"] == "cuda-ipc" and r["strategy"] == "v3"]
    assert v3 and all(r["extra"]["copy_executor"] for r in v3)  # type: ignore[index]
