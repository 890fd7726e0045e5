"""Shared fixtures: tests run on CPU, on loopback, with small models."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
