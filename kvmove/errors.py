"""Errors that carry a user-facing message; the CLI turns each into one line on stderr.

KvmoveError (bad usage or bad input, nothing ran): exit code 2. JobFailed (the job ran and its result is wrong: a
sync that did not verify, no live engine, a migration that did not continue identically): exit code 1.
"""


class KvmoveError(Exception):
    """Base class: a problem with the user's input or environment, worded for the user."""


class ModelError(KvmoveError):
    """Unknown model, unsupported architecture or malformed config."""


class LayoutError(KvmoveError):
    """A trainer or engine layout that violates a named constraint."""


class PlanError(KvmoveError):
    """A sharding plan that cannot be built (unrecordable loader, uncovered parameter, unroutable slice)."""


class UnrecordableOpError(PlanError, NotImplementedError):
    """A weight loader applied an op to a recording tensor that needs values or is not view-like."""


class MissingDependencyError(KvmoveError):
    """An optional dependency is not installed; the message names the extra that provides it."""


class KVCacheError(KvmoveError):
    """Misuse of a KV pool or radix tree: double free, foreign page ids, geometry/dtype/shape mismatch."""


class JobFailed(Exception):
    """The job ran and failed (exit code 1); the message names what failed (ranks, syncs, requests)."""
