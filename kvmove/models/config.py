"""Model configuration: the fields of an HF ``config.json`` that decide tensor names and shapes."""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmove.errors import ModelError

ENGINE_DTYPES = ("bf16", "fp8")
"""Weight formats an inference engine can hold (kvmove.models.checkpoint says what each one loads)."""


@dataclass(frozen=True)
class ModelConfig:
    """One model's architecture, as its HF config states it (missing fields take HF defaults)."""

    name: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int
    head_dim: int
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    qk_norm: bool = False
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_shared_experts: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # MLA (DeepSeek-V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    engine_dtype: str = "bf16"
    """The engine's weight format (one of ENGINE_DTYPES): not an HF field, chosen where the config is built.
    The trainer always holds the BF16 checkpoint; "fp8" engines hold kvmove.models.checkpoint's FP8 one."""
    checkpoint: str | None = None
    """A checkpoint directory (config.json + safetensors) whose headers give the tensor table; None: the table
    transformers' model of the config describes (kvmove.models.table)."""
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False, repr=False)
    raw: tuple[tuple[str, Any], ...] = field(default=(), compare=False, repr=False)
    """The HF config as given (overrides applied), frozen: what :func:`hf_dict` starts from."""
    spelling: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    """Our field -> the HF key it was read from, where the architecture spells it otherwise."""

    def __post_init__(self) -> None:
        if self.engine_dtype not in ENGINE_DTYPES:
            raise ModelError(f"engine dtype {self.engine_dtype!r} is not one of {', '.join(ENGINE_DTYPES)}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3, Kimi K2): KV through a low-rank latent."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen2ForCausalLM": {"attention_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"attention_bias": False, "qk_norm": True},
    "Qwen3MoeForCausalLM": {"attention_bias": False, "qk_norm": True},
    "DeepseekV3ForCausalLM": {"attention_bias": False, "qk_norm": False},
}

_DENSE = ("Qwen3ForCausalLM", "Qwen2ForCausalLM")
"""Dense architectures whose configs may still carry an (unused) ``num_experts``."""

# HF spells some fields differently per architecture; these map them onto ours.
_RENAMES = {"n_routed_experts": "num_experts", "num_local_experts": "num_experts"}  # DeepSeek, transformers 5
_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
_NOT_FROM_HF = ("name", "architecture", "extra", "engine_dtype", "checkpoint", "raw", "spelling")
NOT_HF = (*_NOT_FROM_HF, "qk_norm")
"""Fields that are kvmove's, not keys of an HF config."""


def config_from_dict(
    raw: dict[str, Any], name: str, overrides: dict[str, Any] | None = None, checkpoint: str | None = None
) -> ModelConfig:
    """Build a config from an HF-style dict plus ``overrides``; raise ModelError naming the problem.

    Any causal-LM architecture transformers knows is accepted; fields the dict leaves out that decide tensor
    shapes (``head_dim``, ``tie_word_embeddings``) take the architecture's own defaults from transformers."""
    data = {k: v for k, v in raw.items() if not k.startswith("_")}
    _check_override_keys(overrides or {}, set(data), name)
    data.update(overrides or {})
    archs = data.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ModelError(f"config of {name!r} has no 'architectures' list")
    arch = archs[0]
    values: dict[str, Any] = {"name": name, "architecture": arch, **_ARCH_DEFAULTS.get(arch, {})}
    values |= _transformers_defaults(arch, data, name)
    extra = []
    spelling = []
    for hf_key, value in data.items():
        key = _RENAMES.get(hf_key, hf_key)
        if key != hf_key:
            spelling.append((key, hf_key))
        if key in _FIELDS and key not in _NOT_FROM_HF:
            values[key] = value
        elif key != "architectures":
            extra.append((key, _freeze(value)))
    if "head_dim" not in values or values["head_dim"] is None:
        heads = values.get("num_attention_heads")
        if not heads:
            raise ModelError(f"config of {name!r} lacks num_attention_heads")
        values["head_dim"] = int(values.get("hidden_size", 0)) // int(heads)
    if "num_key_value_heads" not in values:
        values["num_key_value_heads"] = values.get("num_attention_heads")
    if arch in _DENSE:
        values["num_experts"] = 0
    values["mlp_only_layers"] = tuple(values.get("mlp_only_layers") or ())
    values["engine_dtype"] = _engine_dtype(data.get("quantization_config"), name)
    values["extra"] = tuple(sorted(extra))
    values["raw"] = _freeze_raw(data)
    values["spelling"] = tuple(spelling)
    values["checkpoint"] = checkpoint
    missing = [f for f in _REQUIRED if values.get(f) in (None, "")]
    if missing:
        raise ModelError(f"config of {name!r} lacks required field(s): {', '.join(missing)}")
    try:
        cfg = ModelConfig(**{k: _coerce(k, v) for k, v in values.items()})
    except (TypeError, ValueError) as exc:
        raise ModelError(f"config of {name!r} is malformed: {exc}") from None
    _check(cfg)
    return cfg


def _transformers_defaults(arch: str, data: dict[str, Any], name: str) -> dict[str, Any]:
    """The shape-deciding fields ``data`` leaves out, as transformers' config class of ``arch`` defaults them
    (ModelError where transformers knows no such causal LM); kept on disk between runs (kvmove.models.diskcache)."""
    from kvmove.models.diskcache import remembered

    wanted = [k for k in ("head_dim", "tie_word_embeddings") if k not in data]
    fields = {k: v for k, v in data.items() if k in ("hidden_size", "num_attention_heads")}
    key = {"architecture": arch, "model_type": data.get("model_type"), "wanted": wanted, "fields": fields}
    answer: dict[str, Any] = remembered("defaults", key, lambda: _asked_transformers(arch, data, wanted, fields, name))
    return answer


def _asked_transformers(
    arch: str, data: dict[str, Any], wanted: list[str], fields: dict[str, Any], name: str
) -> dict[str, Any]:
    from kvmove.models.hf import model_type_of, quiet_transformers

    model_type = model_type_of(arch, data.get("model_type"))
    if not wanted:
        return {}
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as exc:
        raise ModelError(f"config of {name!r}: transformers cannot build a {model_type} config: {exc}") from None
    out = {k: getattr(config, k, None) for k in wanted}
    return {k: v for k, v in out.items() if v is not None}


def hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg`` as an HF config dict: the config it was read from, with every field's current value in the
    architecture's own spelling (so a ``dataclasses.replace``'d config describes its own tensors)."""
    out = {k: _thaw_raw(v) for k, v in cfg.raw}
    spelled = dict(cfg.spelling)
    for f in dataclasses.fields(cfg):
        if f.name in NOT_HF:
            continue
        key, value = spelled.get(f.name, f.name), getattr(cfg, f.name)
        if key in out or value != f.default:
            out[key] = list(value) if isinstance(value, tuple) else value
    out["architectures"] = [cfg.architecture]
    if cfg.engine_dtype == "bf16":  # an FP8 model served in BF16 (--engine-dtype bf16): no quantization
        out.pop("quantization_config", None)
    return out


def _freeze_raw(data: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in data.items()))


def _thaw_raw(text: str) -> Any:
    return json.loads(text)


def _engine_dtype(quantization: Any, name: str) -> str:
    """The engine dtype an HF ``quantization_config`` implies: block FP8 (``quant_method: fp8`` with
    ``weight_block_size: [128, 128]``, as DeepSeek-V3, Kimi K2 and Qwen3-*-FP8 ship) or none (bf16)."""
    if not quantization:
        return "bf16"
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    block = list(quantization.get("weight_block_size") or ()) if isinstance(quantization, dict) else []
    if method != "fp8" or block != [128, 128]:
        raise ModelError(
            f"config of {name!r}: quantization_config {quantization!r} is not supported "
            "(only quant_method fp8 with weight_block_size [128, 128])"
        )
    return "fp8"


def _check_override_keys(overrides: dict[str, Any], present: set[str], name: str) -> None:
    """An override must name a field kvmove reads or one the config already has; a typo is refused, naming the
    closest known key (a silently ignored ``num_expert=64`` would change nothing)."""
    known = present | set(_RENAMES) | {k for k in _FIELDS if k not in ("name", "architecture", "extra")}
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ModelError(f"override key {key!r} is not a field of the config of {name!r}{hint}")


def load_config_file(path: Path, overrides: dict[str, Any] | None = None, checkpoint: str | None = None) -> ModelConfig:
    """Read an HF-style ``config.json``; its directory name (or file stem) names the model."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"no such config file: {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {path} as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path} is not a JSON object")
    name = path.parent.name if path.name == "config.json" else path.stem
    return config_from_dict(raw, name, overrides, checkpoint)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["num_experts=8", "tie_word_embeddings=true"]`` -> typed dict (JSON values, else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ModelError(f"override {item!r} is not of the form key=value")
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
)


def _coerce(key: str, value: Any) -> Any:
    kind = _FIELDS[key].type if key in _FIELDS else None
    if kind == "int" and not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if kind == "int" and value < 0:
        raise ValueError(f"{key} must be >= 0, got {value}")
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _check(cfg: ModelConfig) -> None:
    positive = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ]
    positive.append("head_dim")
    for key in positive:
        if getattr(cfg, key) <= 0:
            raise ModelError(f"config of {cfg.name!r}: {key} must be > 0")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelError(
            f"config of {cfg.name!r}: num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})"
        )
    if cfg.is_moe and cfg.num_experts_per_tok <= 0:
        raise ModelError(f"config of {cfg.name!r}: an MoE needs num_experts_per_tok > 0")
    if cfg.is_mla and min(cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) <= 0:
        raise ModelError(
            f"config of {cfg.name!r}: MLA needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim > 0"
        )


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value
