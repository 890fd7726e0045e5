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
