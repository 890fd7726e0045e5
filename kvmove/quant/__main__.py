"""``python -m kvmove.quant``: the cross-backend bit check, the exhaustive proofs of the fast Triton variant, and
the quantizer micro-benchmark (GB/s and the fraction of the same run's device-copy rate), as one JSON object."""

from __future__ import annotations

import json
import sys

import torch

from kvmove.quant.check import available_backends, check_backends
from kvmove.quant.speed import measure


def main() -> int:
    checks = check_backends()
    proofs = []
    if torch.cuda.is_available() and ("triton", "cuda") in available_backends():
        from kvmove.quant.exhaustive import prove_all

        proofs = [p._asdict() for p in prove_all()]
    copy, throughput = measure()
    report = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "backends": [f"{b}/{d}" for b, d in available_backends()],
        "checks": [c._asdict() for c in checks],
        "all_equal": all(c.equal for c in checks),
        "proofs": proofs,
        "proven": all(p["mismatches"] == 0 for p in proofs),
        "copy_gbps": copy,
        "throughput": [t._asdict() for t in throughput],
    }
    print(json.dumps(report, indent=2))
    return 0 if report["all_equal"] and report["proven"] else 1


if __name__ == "__main__":
    sys.exit(main())
