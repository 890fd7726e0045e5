"""The checkpoint's tensor table, read from the checkpoint's own description rather than written per architecture.

Two sources, one table:

- a **checkpoint directory** (``config.json`` + ``*.safetensors``): the safetensors headers, read with
  safetensors' own ``safe_open`` (names, shapes, dtypes; no tensor data is read). The table is checked against
  the one the config describes, so a checkpoint whose tensors do not tile the architecture is refused by name;
- a bare **config**: transformers' model of it built on the meta device (no memory, no initialization), its
  in-memory names turned into checkpoint names by transformers' own checkpoint conversion mapping
  (``revert_weight_conversion``: transformers 5 holds MoE experts fused, ``mlp.experts.gate_up_proj``
  ``[E, 2I, H]``, where checkpoints hold one tensor per expert and projection).

Decoder layers whose tensors have the same names (up to the index) and shapes are one *kind*; the conversion runs
on one layer of each kind and the other layers repeat its names, so a 1T-parameter model costs its distinct
layers, not its 70k expert tensors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvmove.errors import ModelError
from kvmove.models.config import ModelConfig
from kvmove.models.hf import model_type_of, quiet_transformers
from kvmove.models.tensors import TensorMeta, TensorTable, expert_of, layer_of, with_layer

_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def meta_model(hf: Mapping[str, Any]) -> torch.nn.Module:
    """transformers' model of HF config ``hf`` on the meta device, in bf16 (the weights a BF16 trainer holds)."""
    import transformers

    arch = hf["architectures"][0]
    fields = {k: v for k, v in hf.items() if k != "model_type" and not k.startswith("_")}
    with quiet_transformers():
        try:
            config = transformers.AutoConfig.for_model(model_type_of(arch, hf.get("model_type")), **fields)
        except (ValueError, TypeError, KeyError) as exc:
            raise ModelError(f"transformers cannot build a config for {arch}: {exc}") from None
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@lru_cache(maxsize=32)
def _config_table(frozen: tuple[tuple[str, Any], ...]) -> TensorTable:
    from kvmove.models.diskcache import decode_table, encode_table, remembered

    return remembered("table", frozen, lambda: _built_table(frozen), encode_table, decode_table)


def _built_table(frozen: tuple[tuple[str, Any], ...]) -> TensorTable:
    from transformers.core_model_loading import revert_weight_conversion

    model: Any = meta_model(_thaw(frozen))
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    outside: dict[str, torch.Tensor] = {}
    head_names: set[str] = set()
    for name, t in memory_tensors(model).items():
        layer = layer_of(name)
        if layer is not None:
            by_layer.setdefault(layer, {})[name] = t
            continue
        outside[name] = t
        if not by_layer:
            head_names.add(name)
    sigs = {i: [(with_layer(n, 0), tuple(t.shape)) for n, t in ts.items()] for i, ts in by_layer.items()}
    kinds, firsts = _kinds(sigs)
    wanted = outside | {n: t for i in firsts.values() for n, t in by_layer[i].items()}
    converted = revert_weight_conversion(model, wanted)
    metas = [TensorMeta(n, tuple(converted[n].shape), torch.bfloat16) for n in _module_order(wanted, converted)]
    return _assemble(metas, kinds, firsts, head_names)


class View(NamedTuple):
    """Where one checkpoint tensor lies in a model's parameter: ``param.flatten()[offset:]`` viewed as
    ``shape`` with ``stride`` (a tensor the conversion keeps: offset 0, the parameter's own shape)."""

    param: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def checkpoint_views(model: torch.nn.Module) -> dict[str, View]:
    """Checkpoint name -> where it lies in ``model``'s tensors (:func:`memory_tensors`: parameters, tied ones once,
    and persistent buffers), by running transformers' own checkpoint conversion on stand-ins of them: meta tensors
    for 1-D and 2-D ones (renamed at most), and for fused (3-D) ones a probe holding each (expert, row) index with
    the trailing dims collapsed, so the checkpoint tensors the conversion cuts out say which rows of which expert
    they are (a probe it passes on whole: a checkpoint that keeps the experts fused, gpt-oss and Llama 4).
    ModelError where a checkpoint tensor is no block of rows of one expert."""
    from transformers.core_model_loading import revert_weight_conversion

    params = memory_tensors(model)
    stand_ins: dict[str, torch.Tensor] = {}
    bases: dict[str, int] = {}  # each fused parameter's probe counts on from the last one's: values name it
    for n, p in params.items():
        if p.dim() < 3:
            stand_ins[n] = torch.empty(p.shape, dtype=p.dtype, device="meta")
            continue
        bases[n] = sum(params[m].shape[0] * params[m].shape[1] for m in bases)
        rows = p.shape[0] * p.shape[1]
        stand_ins[n] = torch.arange(bases[n], bases[n] + rows).view(p.shape[0], p.shape[1], *([1] * (p.dim() - 2)))
    storages = {t.untyped_storage()._cdata: n for n, t in stand_ins.items()}
    with quiet_transformers():
        converted = revert_weight_conversion(model, stand_ins)  # type: ignore[arg-type]
    out: dict[str, View] = {}
    for name, t in converted.items():
        param = storages.get(t.untyped_storage()._cdata)
        if param is not None and t.is_meta:
            out[name] = View(param, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))
        elif param is not None and t.shape == stand_ins[param].shape:  # a fused parameter the checkpoint keeps
            shape = tuple(params[param].shape)
            out[name] = View(param, 0, shape, tuple(torch.empty(shape, device="meta").stride()))
        else:
            out[name] = _probed(name, t, params, bases)
    return out


class MemoryLayout(NamedTuple):
    """The tensors a transformers model of a config holds in memory, and where each checkpoint tensor lies in
    them."""

    shapes: dict[str, tuple[int, ...]]
    """In-memory name -> shape (:func:`memory_tensors`)."""
    views: dict[str, View]
    """Checkpoint name -> its view of an in-memory tensor (:func:`checkpoint_views`)."""


def memory_layout(cfg: ModelConfig) -> MemoryLayout:
    """:class:`MemoryLayout` of transformers' model of ``cfg``, built on the meta device (e.g. Mixtral's experts
    fused in memory, per expert in the checkpoint)."""
    from kvmove.models.config import hf_dict

    model = meta_model(hf_dict(cfg))
    shapes = {n: tuple(t.shape) for n, t in memory_tensors(model).items()}
    return MemoryLayout(shapes, checkpoint_views(model))


def _probed(name: str, t: torch.Tensor, params: Mapping[str, torch.Tensor], bases: Mapping[str, int]) -> View:
    """The View of checkpoint tensor ``name`` cut out of a probe (its values: the fused parameter's rows)."""
    if t.is_meta or t.dim() < 1 or t.numel() == 0 or any(s != 1 for s in t.shape[1:]):
        raise ModelError(f"transformers' conversion makes {name} from no block of rows of a fused parameter")
    index = t.reshape(-1)
    first = int(index[0])
    param = next((n for n, b in bases.items() if b <= first < b + params[n].shape[0] * params[n].shape[1]), None)
    contiguous = torch.equal(index, torch.arange(first, first + index.numel()))
    if param is None or not contiguous:
        raise ModelError(f"transformers' conversion makes {name} from no block of rows of a fused parameter")
    p, local = params[param], first - bases[param]
    if local // p.shape[1] != (local + index.numel() - 1) // p.shape[1]:
        raise ModelError(f"transformers' conversion makes {name} from rows of two experts of {param}")
    shape = (index.numel(), *p.shape[2:])
    return View(param, local * math.prod(p.shape[2:]), shape, tuple(torch.empty(shape, device="meta").stride()))


def _module_order(memory: Mapping[str, torch.Tensor], converted: Mapping[str, torch.Tensor]) -> list[str]:
    """Checkpoint names in module order: a name kept by the conversion where its tensor is; the names a
    conversion made (per-expert tensors, renamed routers) where the first in-memory tensor it consumed was,
    expert by expert."""
    made = [n for n in converted if n not in memory]
    out: list[str] = []
    emitted: set[str] = set()
    for name in memory:
        if name in converted:
            out.append(name)
            continue
        layer = layer_of(name)
        batch = [n for n in made if n not in emitted and layer_of(n) == layer]
        batch.sort(key=lambda n: (expert_of(n) or -1, made.index(n)))
        out += batch
        emitted.update(batch)
    return out + [n for n in made if n not in emitted]


def memory_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint of ``model`` is made from: parameters (tied ones once) and persistent buffers (a router's
    score bias), in module order."""
    keys = set(model.state_dict(keep_vars=True))
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for leaf, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if t is not None and prefix + leaf in keys:
                out[prefix + leaf] = t
    params = dict(model.named_parameters())  # remove_duplicate: a tied parameter appears under its first name
    return {n: t for n, t in out.items() if n in params or not isinstance(t, torch.nn.Parameter)}


def _kinds(signatures: Mapping[int, list[tuple[str, tuple[int, ...]]]]) -> tuple[tuple[str, ...], dict[str, int]]:
    """Each layer's kind (``dense``/``moe`` by whether it holds experts, numbered when several differ) and the
    first layer of each kind."""
    names: dict[tuple[tuple[str, tuple[int, ...]], ...], str] = {}
    firsts: dict[str, int] = {}
    kinds = []
    for i in sorted(signatures):
        sig = tuple(sorted(signatures[i]))
        if sig not in names:
            base = "moe" if any(".experts." in n for n, _ in sig) else "dense"
            taken = sum(v.split("-")[0] == base for v in names.values())
            names[sig] = base if taken == 0 else f"{base}-{taken + 1}"
            firsts[names[sig]] = i
        kinds.append(names[sig])
    return tuple(kinds), firsts


def _assemble(
    metas: list[TensorMeta], kinds: tuple[str, ...], firsts: Mapping[str, int], head_names: set[str]
) -> TensorTable:
    per_layer: dict[int, list[TensorMeta]] = {}
    head: list[TensorMeta] = []
    tail: list[TensorMeta] = []
    for t in metas:
        layer = layer_of(t.name)
        if layer is not None:
            per_layer.setdefault(layer, []).append(t)
        else:
            (head if t.name in head_names else tail).append(t)
    templates = {k: (i, tuple(per_layer.get(i, ()))) for k, i in firsts.items()}
    return TensorTable(tuple(head), kinds, templates, tuple(tail))


@lru_cache(maxsize=32)
def table_of(cfg: ModelConfig) -> TensorTable:
    """The tensor table of ``cfg`` (memoized): its checkpoint directory's headers (checked against its config)
    or, with no checkpoint, what its config describes (kept on disk between runs: kvmove.models.diskcache)."""
    from kvmove.models.config import hf_dict

    frozen = _freeze(hf_dict(cfg))
    return _config_table(frozen) if cfg.checkpoint is None else _checked_headers(cfg.checkpoint, frozen)


def hf_tensors(cfg: ModelConfig, layers: Iterable[int] | None = None) -> list[TensorMeta]:
    """All tensors of the checkpoint in file order, or only those of ``layers`` plus the non-layer ones."""
    if layers is None:
        return list(_every_tensor(cfg))
    return table_of(cfg).tensors(layers)


@lru_cache(maxsize=8)
def _every_tensor(cfg: ModelConfig) -> tuple[TensorMeta, ...]:
    """Every tensor of ``cfg``'s checkpoint, built once (Kimi K2: 69,975 of them; planners ask again and again)."""
    return tuple(table_of(cfg).tensors())


def layer_tensors(cfg: ModelConfig, i: int) -> list[TensorMeta]:
    """The tensors of decoder layer ``i``."""
    return table_of(cfg).layer(i)


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    """Layers of one kind have identical tensor names (up to the index) and shapes (``dense``, ``moe``, ...)."""
    kinds = table_of(cfg).kinds
    if not 0 <= layer < len(kinds):
        raise ModelError(f"layer {layer} is outside the {len(kinds)} layers of {cfg.name}")
    return kinds[layer]


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether decoder layer ``layer`` holds routed experts (read off the tensor table)."""
    return layer_kind(cfg, layer).startswith("moe")


@lru_cache(maxsize=8)
def _checked_headers(directory: str, frozen: tuple[tuple[str, Any], ...]) -> TensorTable:
    found = header_table(directory)
    check_matches(found, _built_table(frozen), directory)  # headers are read each time: nothing from the disk cache
    return found


def header_table(directory: str | Path) -> TensorTable:
    """The table of the safetensors files in ``directory``, read from their headers only."""
    from safetensors import safe_open

    root = Path(directory)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors files in {root}")
    seen: dict[str, str] = {}
    metas: list[TensorMeta] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name in seen:
                    raise ModelError(f"tensor {name} is in both {seen[name]} and {path.name} of {root}")
                seen[name] = path.name
                piece = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise ModelError(f"tensor {name} of {root} has dtype {piece.get_dtype()}, which kvmove cannot hold")
                metas.append(TensorMeta(name, tuple(piece.get_shape()), dtype))
    _check_index(root, seen)
    return _from_names(metas)


def _check_index(root: Path, seen: Mapping[str, str]) -> None:
    index = root / "model.safetensors.index.json"
    if not index.exists():
        return
    weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
    for name, file in weight_map.items():
        if seen.get(name) != file:
            raise ModelError(f"{index.name} puts {name} in {file}, but {root} has it in {seen.get(name, 'no file')}")


def _from_names(metas: list[TensorMeta]) -> TensorTable:
    """A table from a flat list (layers grouped by index, kinds by their names and shapes)."""
    per_layer: dict[int, list[TensorMeta]] = {}
    for t in metas:
        layer = layer_of(t.name)
        if layer is not None:
            per_layer.setdefault(layer, []).append(t)
    n = max(per_layer, default=-1) + 1
    missing = [i for i in range(n) if i not in per_layer]
    if missing:
        raise ModelError(f"the checkpoint has no tensors of decoder layer {missing[0]} (of {n})")
    sigs = {i: [(with_layer(t.name, 0), t.shape) for t in ts] for i, ts in per_layer.items()}
    kinds, firsts = _kinds(sigs)
    head = {t.name for t in metas if layer_of(t.name) is None and "embed" in t.name}
    return _assemble(metas, kinds, firsts, head)


def check_matches(found: TensorTable, described: TensorTable, where: str) -> None:
    """``found`` (a checkpoint's headers) holds exactly the tensors ``described`` (its config) lists, shape for
    shape; else ModelError naming the first tensor that differs."""
    have = {t.name: t.shape for t in found.tensors()}
    want = {t.name: t.shape for t in described.tensors()}
    for name, shape in want.items():
        if name not in have:
            raise ModelError(f"checkpoint {where} lacks tensor {name} {shape} that its config.json describes")
        if have[name] != shape:
            raise ModelError(f"checkpoint {where}: tensor {name} is {have[name]}, its config.json describes {shape}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ModelError(f"checkpoint {where} has tensor {extra[0]} that its config.json does not describe")


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("__list__", *(_freeze(v) for v in value))
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and value and value[0] == "__list__":
        return [_thaw(v) for v in value[1:]]
    if isinstance(value, tuple):
        return {k: _thaw(v) for k, v in value}
    return value
