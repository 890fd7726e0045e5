"""``python -m kvmove.quant``: the cross-backend bit check and throughput of the block-FP8 quantizer, as JSON."""

from __future__ import annotations

import json
import sys

import torch

from kvmove.quant.check import available_backends, check_backends, measure


def main() -> int:
    checks = check_backends()
    report = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "backends": [f"{b}/{d}" for b, d in available_backends()],
        "checks": [c._asdict() for c in checks],
        "all_equal": all(c.equal for c in checks),
        "throughput": [t._asdict() for t in measure()],
    }
    print(json.dumps(report, indent=2))
    return 0 if report["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
