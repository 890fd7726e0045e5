"""``python -m kvmove.quant``: a thin call into ``kvmove check quant --json`` (the cross-backend bit check, the
exhaustive proofs of the fast Triton variant and the quantizer micro-benchmark, as one JSON object)."""

from __future__ import annotations

import sys

from kvmove.cli.main import run


def main() -> int:
    return run(["check", "quant", "--json"])


if __name__ == "__main__":
    sys.exit(main())
