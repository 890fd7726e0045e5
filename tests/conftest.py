"""Shared fixtures: tests run on CPU, on loopback, with small models."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# rows the tests record (into temporary folders) carry this commit: recording refuses a dirty tree, and a test must
# not fail because the checkout it runs in has uncommitted changes (tests of the refusal set their own)
os.environ.setdefault("KVMOVE_GIT_COMMIT", "0000000000aa")
# what transformers says about a config is kept on disk between runs (kvmove.models.diskcache): each test session
# starts from an empty cache of its own, so a test never reads what another run (or a monkeypatched one) wrote
os.environ["KVMOVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvmove-test-cache-")

import pytest

atexit.register(shutil.rmtree, os.environ["KVMOVE_CACHE_DIR"], True)

pytest_plugins = ["server_fixtures"]  # kvmove servers in threads: start_server, pair, pair_over, transport


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray (loopback only) shared by every test that needs actors."""
    ray = pytest.importorskip("ray")
    from kvmove.sync.launchers.ray import start_ray

    start_ray(None)
    yield ray
    ray.shutdown()
