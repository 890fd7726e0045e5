"""One live validation of the committed rows (fit, leave-one-source-out, our own runs), shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmove.bench.sim.measure import costs_from_rows
from kvmove.bench.sim.rows import measured_rows
from kvmove.bench.sim.validation import Validation, validate_all

RESULTS = Path(__file__).resolve().parents[3] / "results"


@pytest.fixture(scope="session")
def repo_validation() -> Validation:
    rows = measured_rows(RESULTS)
    return validate_all(costs_from_rows(rows), rows)
