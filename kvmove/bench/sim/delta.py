"""Delta syncs priced: the changed fraction per region class as a parameter, the bytes from the encoding's owner.

A delta sync (``kvmove sync-weights --delta``, ``docs/delta-sync.md``) compares each packed pull's source regions
with the image the trainer last served (a device-memory pass over the pull's bytes, its source and the image),
sends the smallest encoding of the changed words, and the engine scatters them straight into its parameters. So
the traffic of a delta sync is the dense traffic with, per engine rank and group:

- the wire bytes of its pulls from :func:`kvmove.sync.delta.encoding.delta_bytes` (the rule's owner: the smallest
  encoding, never more than dense) at the changed fraction of the words those pulls carry, the fraction weighted
  over the region classes of ``kvmove.sync.delta.detect.region_class`` that make up the pulls;
- a detection pass over every byte the trainer would pack (``detect``), paid whatever encoding wins;
- an apply pass for every pull that went as a delta (``apply``), priced over the pull's bytes at the rate the
  delta suite measures; none for pulls that went dense.

Which pulls can go as a delta is the sync's rule: packed pulls only (direct reads are planned packed under
``--delta``), never a broadcast, never pulls the engine quantizes itself. The rates of the two passes are costs
(``delta_detect_efficiency``, ``delta_apply_efficiency``) set by the delta suite's rows
(``kvmove bench run --suite delta``) through setup matching; the fractions are a setup parameter
(``--delta-fraction``: one number, per class, or ``measured``: the newest delta rows' medians).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from kvmove.bench.sim.fractions import WORD_BYTES
from kvmove.sync.delta.detect import REGION_CLASSES

if TYPE_CHECKING:
    from kvmove.bench.sim.setup import SimSetup
    from kvmove.bench.sim.traffic import Traffic


def deltable(s: SimSetup, broadcast: bool) -> bool:
    """Whether the sync's rule lets any pull of this strategy go as a delta."""
    return s.delta is not None and not broadcast and not (s.dtype == "fp8" and s.quantize_on == "engine")


def apply_delta(t: Traffic, s: SimSetup) -> Traffic:
    """The dense traffic ``t`` of a packed strategy as a delta sync at ``s.delta``'s fractions (see the module
    docstring); ``t`` itself for a dense sync or a strategy that cannot send deltas."""
    if s.delta is None or not deltable(s, t.strategy.broadcast):
        return t
    e, tr = dict(t.e), dict(t.t)
    dense = e["recv"]
    changed = np.sum([e[f"recv.{c}"] * s.delta.of(c) for c in REGION_CLASSES], axis=0)
    coded, went = _coded(dense, changed, np.maximum(e["pulls"], 1.0))
    e["scatter"] = np.where(changed > 0, e["scatter"], 0.0)  # a pull with nothing changed is neither read nor landed
    ratio = np.divide(coded.sum(axis=1), dense.sum(axis=1), out=np.ones(len(dense)), where=dense.sum(axis=1) > 0)
    e["recv"], e["kept"] = coded, np.where(dense > 0, e["kept"] * coded / np.maximum(dense, 1.0), e["kept"])
    e["apply"] = np.where(went, dense, 0.0)
    tr["send"], tr["detect"] = tr["send"] * ratio[:, None], tr["send"].copy()  # every packed byte is compared
    return dataclasses.replace(t, e=e, t=tr, max_request=t.max_request * ratio)


def _coded(dense: np.ndarray, changed: np.ndarray, pulls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per (group, engine rank): wire bytes of its pulls as deltas (``changed`` of their ``dense`` bytes changed,
    spread evenly over its ``pulls``), and whether they went as deltas that change something."""
    from kvmove.sync.delta.encoding import delta_bytes

    coded = np.zeros_like(dense)
    for (g, k), nbytes in np.ndenumerate(dense):
        if nbytes <= 0:
            continue
        each = round(float(nbytes / pulls[g, k]) / WORD_BYTES) * WORD_BYTES
        frac = min(1.0, float(changed[g, k] / nbytes))
        coded[g, k] = min(nbytes, delta_bytes(each, frac, WORD_BYTES) * pulls[g, k])
    return coded, (coded < dense) & (changed > 0)
