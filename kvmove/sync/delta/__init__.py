"""Delta syncs: move only the elements of a packed pull that changed since the engine's last sync.

- :mod:`~kvmove.sync.delta.encoding`: the compact encodings (index list or bitmap, plus values) and the rule that
  picks the smallest of them and dense, per pull; :func:`~kvmove.sync.delta.encoding.delta_bytes` prices one
  region for a given changed fraction (what a simulator calls).
- :mod:`~kvmove.sync.delta.detect`: the trainer's side, the image it last served each engine rank per pull and the
  detection and encoding into the serve slot.
- :mod:`~kvmove.sync.delta.apply`: the engine's side, a patch decoded from the receive slot and scattered into
  the parameters through the pull's own landing program.
- :mod:`~kvmove.sync.delta.stepping`: a realistic training step to measure it on (FP32 master weights stepped by
  AdamW, a BF16 image), and its replay for verification.
"""

from __future__ import annotations

import importlib

import torch

from kvmove.quant.quantizer import default_backend

KERNELS = {"trainer": "kvmove.sync.delta.triton_diff", "engine": "kvmove.sync.delta.triton_apply"}
"""The Triton kernels each side of a delta sync runs on CUDA: the trainer's comparison, the engine's scatter."""


def warm(device: torch.device, side: str) -> None:
    """Compile ``side``'s delta kernels on ``device`` where they would run (CUDA with triton), so that its first
    delta sync pays no compilation; nothing elsewhere."""
    if default_backend(torch.empty(0, device=device)) == "triton":
        importlib.import_module(KERNELS[side]).warm(device)
