"""Full checkpoints to sync and to verify against: deterministic seeded weights (the same bits for one name, seed,
version and device kind, on every rank and in every process), or the HF checkpoint a trainer saved."""

from __future__ import annotations

import zlib

import torch

from kvmove.errors import KvmoveError
from kvmove.models.config import ModelConfig
from kvmove.models.table import hf_tensors
from kvmove.models.tensors import TensorMeta
from kvmove.models.totals import model_totals

VERIFY_LIMIT_BYTES = 2 << 30
"""The largest full checkpoint materialized here (for verification, or a server's seeded weights)."""


def seeded_tensor(t: TensorMeta, seed: int, version: int = 0, device: str = "cpu") -> torch.Tensor:
    """Deterministic random weights for one HF tensor (same name, seed, version and device kind: same bits)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + version * 7919 + zlib.crc32(t.name.encode())) & 0x7FFFFFFF)
    if device == "cpu":
        return torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
    return torch.randn(t.shape, generator=g, dtype=t.dtype, device=device)


def check_verifiable(cfg: ModelConfig) -> None:
    """Refuse (before any work) models whose full checkpoint is too large to materialize here."""
    total = model_totals(cfg).total_bytes
    if total > VERIFY_LIMIT_BYTES:
        raise KvmoveError(
            f"verifying {cfg.name} would materialize its full checkpoint ({total / 1e9:.1f} GB); "
            "use a small preset (e.g. qwen3-moe-tiny) or --override to shrink it"
        )


def seeded_checkpoint(cfg: ModelConfig, seed: int, version: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The full checkpoint with seeded random weights, generated on ``device`` (the kind of device decides the
    bits: generate where the trainer does); refuses models too large to materialize here."""
    check_verifiable(cfg)
    return {t.name: seeded_tensor(t, seed, version, device) for t in hf_tensors(cfg)}


def saved_checkpoint(cfg: ModelConfig, directory: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The HF checkpoint a trainer saved in ``directory`` (``*.safetensors``, as ``save_pretrained`` writes them),
    checked to hold exactly the tensors of ``cfg`` with their shapes and dtypes."""
    from pathlib import Path

    try:
        from safetensors.torch import load_file
    except ImportError:
        raise KvmoveError("reading a saved checkpoint needs safetensors: pip install 'kvmove[train]'") from None
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise KvmoveError(f"no *.safetensors checkpoint in {directory}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f), device=device))
    want = {t.name: t for t in hf_tensors(cfg)}
    for name in sorted(set(want) ^ set(out))[:1]:
        where = "lacks" if name in want else "has a tensor not in the model:"
        raise KvmoveError(f"the checkpoint in {directory} {where} {name}")
    for t in want.values():
        if tuple(out[t.name].shape) != t.shape or out[t.name].dtype != t.dtype:
            raise KvmoveError(
                f"{t.name} in {directory} is {tuple(out[t.name].shape)} {out[t.name].dtype}, not {t.shape}"
            )
    return {t.name: out[t.name] for t in want.values()}
