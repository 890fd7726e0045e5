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
from kvmove.bench.results import append_rows

if __name__ == "__main__":
    out = Path(sys.argv[1])
    suite = replace(GpuSuite.cpu_twin(), transports=("nixl", "nccl"), variants="v3,broadcast")
    gpu_suite(suite, lambda rows: append_rows(out, "gpu", rows) if rows else None, print)
    print("imported:", sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2].split(","))))
"""


def _rows(results: Path) -> list[dict[str, object]]:
    rows = load_results(results).to_dict("records")
    for r in rows:
        r["extra"] = json.loads(str(r["extra"]))
    return rows


def _check(rows: list[dict[str, object]], transports: set[str], strategies: set[str]) -> None:
    ceilings = [r for r in rows if str(r["name"]).startswith("ceiling")]
    syncs = [r for r in rows if str(r["name"]).startswith("sync")]
    kv = [r for r in rows if r["name"] == "kv migration copy"]
    p2p = next(float(r["gbps"]) for r in ceilings if str(r["name"]).startswith("ceiling p2p"))  # type: ignore[arg-type]
    assert any("send/recv" in str(r["name"]) for r in ceilings) and p2p > 0
    assert kv and all(r["extra"]["verified"] for r in kv)  # type: ignore[index]
    assert {r["transport"] for r in syncs if r["strategy"] != "broadcast"} == transports
    assert {r["strategy"] for r in syncs} == strategies
    for r in syncs:
        extra = r["extra"]
        assert extra["verified"] is True and extra["launcher"] == "processes", r  # type: ignore[index]
        assert r["link_limit_gbps"] == p2p and extra["fraction_of_p2p"] == pytest.approx(r["gbps"] / p2p)  # type: ignore[index,operator]


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
    _check(_rows(tmp_path / "results"), transports, {"v3", "broadcast"})


@pytest.mark.gpu
def test_gpu_suite_on_two_gpus(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    suite = replace(
        GpuSuite(),
        layers=1,
        syncs=2,
        transports=("cuda-ipc", "nccl"),
        variants="v2,v3,broadcast",
        prompt_lens=(1024,),
        ceiling_bytes=256 << 20,
    )
    from kvmove.bench.results import append_rows

    gpu_suite(suite, lambda rows: append_rows(tmp_path, "gpu", rows) if rows else None, print)
    _check(_rows(tmp_path), {"cuda-ipc", "nccl"}, {"v2", "v3", "broadcast"})
