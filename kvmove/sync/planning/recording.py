"""Recording tensors: stand-ins with shape and dtype but no data, which log what a weight loader does to them.

A loader is run over recording tensors instead of real ones (a *dry run*). Every view-like op on a recording
tensor returns a child that remembers the op; the final ``param_view.copy_(recording)`` is captured by a
:class:`RecordingSink` together with the destination's offset, shape and stride inside the parameter.
Ops that would need values (arithmetic, ``.to``, ``.item``, mask indexing, ...) raise
:class:`~kvmove.errors.UnrecordableOpError` naming the op, so a loader that peeks at data fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from kvmove.errors import PlanError, UnrecordableOpError
from kvmove.models.tensors import TensorMeta

# Python-level ops a loader may apply; each keeps the data and only changes the view.
VIEW_OPS = (
    "narrow",
    "view",
    "reshape",
    "__getitem__",
    "squeeze",
    "unsqueeze",
    "transpose",
    "t",
    "permute",
    "flatten",
    "contiguous",
    "chunk",
    "split",
    "unbind",
    "select",
    "detach",
)
_METADATA = (
    "size",
    "dim",
    "numel",
    "stride",
    "storage_offset",
    "is_contiguous",
    "element_size",
    "__len__",
    "__repr__",
    "__format__",
)
_PROPERTIES = (
    "shape",
    "dtype",
    "device",
    "ndim",
    "requires_grad",
    "is_meta",
    "nbytes",
    "itemsize",
    "is_cuda",
    "T",
)


class FunctionTable(NamedTuple):
    """torch's view functions by op name, and the functions that only read metadata."""

    views: dict[Callable[..., Any], str]
    meta: set[Callable[..., Any]]


def _function_table() -> FunctionTable:
    views: dict[Callable[..., Any], str] = {}
    for name in VIEW_OPS:
        views[getattr(torch.Tensor, name)] = name
        if hasattr(torch, name) and name not in ("detach",):
            views[getattr(torch, name)] = name
    views[torch.Tensor.T.__get__] = "t"  # type: ignore[attr-defined]
    meta = {getattr(torch.Tensor, n) for n in _METADATA}
    meta |= {getattr(torch.Tensor, n).__get__ for n in _PROPERTIES if n != "T"}
    return FunctionTable(views, meta)


_VIEW_FUNCS, _META_FUNCS = _function_table()


class Op(NamedTuple):
    """One recorded view op; ``pick`` selects one output of a multi-output op (chunk, split, unbind)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    pick: int | None = None

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        if self.name == "__getitem__":
            out = t[self.args[0]]
        else:
            out = getattr(torch.Tensor, self.name)(t, *self.args, **dict(self.kwargs))
        return out[self.pick] if self.pick is not None else out

    def __str__(self) -> str:
        args = ", ".join([*map(repr, self.args), *(f"{k}={v!r}" for k, v in self.kwargs)])
        pick = f"[{self.pick}]" if self.pick is not None else ""
        return f"{self.name}({args}){pick}"


def replay(ops: Iterable[Op], tensor: torch.Tensor) -> torch.Tensor:
    """Apply a recorded op chain to a real tensor."""
    for op in ops:
        tensor = op.apply(tensor)
    return tensor


class StridedView(NamedTuple):
    """A view into a contiguous tensor's flat elements: ``t.as_strided(shape, stride, offset)``."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @classmethod
    def of(cls, t: torch.Tensor) -> StridedView:
        return cls(int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """This view of ``t``'s elements (offsets count from ``t``'s own first element)."""
        return t.as_strided(self.shape, self.stride, t.storage_offset() + self.offset)


class Capture(NamedTuple):
    """One ``copy_`` seen by the sink: recording ``source`` (after ``ops``) into parameter ``param``.

    When an op of the chain copied (a reshape no view can express, e.g. merging query groups that are strided
    in a fused tensor), the copied elements may still be one strided view of the source over a finer shape:
    ``src`` and ``dst`` are then both expressed over that shape (each dim of the copy split into factors, in
    row-major order, so the payload's bytes are the same).
    """

    source: str
    ops: tuple[Op, ...]
    src: StridedView | None
    """The copied data as a view of the source tensor; None when no strided view expresses it."""
    src_dtype: torch.dtype
    param: str
    dst: StridedView
    dst_dtype: torch.dtype


class RecordingSink:
    """Collects the captures of one dry run; destinations are attributed to parameters by storage."""

    def __init__(self, model: nn.Module) -> None:
        self.captures: list[Capture] = []
        self._params = {p.untyped_storage()._cdata: n for n, p in model.named_parameters()}

    def record(self, dst: torch.Tensor, src: RecordingTensor) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise PlanError(
                f"copy_ of {src.source} {tuple(src.shape)} into {tuple(dst.shape)} would broadcast; "
                "only exact-shape copies can be recorded"
            )
        param = self._params.get(dst.untyped_storage()._cdata)
        if param is None:
            raise PlanError(f"loader copied {src.source} into a tensor that is not a parameter of the model")
        view, into = None, StridedView.of(dst)
        if src.meta.untyped_storage()._cdata == src.base_id:
            view = StridedView.of(src.meta)
        elif (refined := refine(src.root_shape, src.chain, into)) is not None:
            view, into = refined
        self.captures.append(Capture(src.source, src.chain, view, src.dtype, param, into, dst.dtype))


class RecordingTensor(torch.Tensor):
    """A data-less tensor of one HF checkpoint tensor that records view ops (see module docstring)."""

    source: str
    chain: tuple[Op, ...]
    meta: torch.Tensor
    base_id: int
    sink: RecordingSink
    root_shape: tuple[int, ...]
    _allowed: ClassVar[tuple[str, ...]] = VIEW_OPS

    @staticmethod
    def __new__(
        cls, meta: torch.Tensor, source: str, chain: tuple[Op, ...], sink: RecordingSink, base_id: int
    ) -> RecordingTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=torch.device("meta"),
            requires_grad=False,
        )
        out.meta, out.source, out.chain, out.sink, out.base_id = meta, source, chain, sink, base_id
        out.root_shape = tuple(meta.shape)
        return out

    @classmethod
    def of(cls, t: TensorMeta, sink: RecordingSink) -> RecordingTensor:
        base = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return cls(base, t.name, (), sink, base.untyped_storage()._cdata)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        chain = ".".join(map(str, self.chain))
        return f"RecordingTensor({self.source}{'.' + chain if chain else ''}, shape={tuple(self.shape)})"

    def _child(self, meta: torch.Tensor, op: Op) -> RecordingTensor:
        child = RecordingTensor(meta, self.source, (*self.chain, op), self.sink, self.base_id)
        child.root_shape = self.root_shape
        return child

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            return _record_copy(args, kwargs)
        if func in _META_FUNCS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = _VIEW_FUNCS.get(func)
        if name is None:
            raise UnrecordableOpError(_refusal(func, args))
        self, rest = args[0], tuple(args[1:])
        flat, _ = tree_flatten((rest, kwargs))
        if not isinstance(self, RecordingTensor) or any(isinstance(a, torch.Tensor) for a in flat):
            raise UnrecordableOpError(_refusal(func, args, "with tensor arguments (mask or index tensors)"))
        if name == "__getitem__":
            rest = (_freeze_index(rest[0]),)
        op = Op(name, rest, tuple(sorted(kwargs.items())))
        out = op._replace(pick=None).apply(self.meta)
        if isinstance(out, (tuple, list)):
            return type(out)(self._child(o, op._replace(pick=i)) for i, o in enumerate(out))
        return self._child(out, op)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise UnrecordableOpError(_refusal(func, args))


def _record_copy(args: Any, kwargs: Any) -> Any:
    dst, src = args[0], args[1]
    if isinstance(dst, RecordingTensor):
        raise UnrecordableOpError(f"copy_ into recording tensor {dst.source}: loaders must only read HF tensors")
    if not isinstance(src, RecordingTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return dst.copy_(src, **kwargs)
    src.sink.record(dst, src)
    return dst


def _refusal(func: Any, args: Any, why: str = "") -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    src = next((a.source for a in tree_flatten(args)[0] if isinstance(a, RecordingTensor)), "?")
    why = why or "it is not view-like (needs values or changes dtype/device)"
    allowed = ", ".join(n.strip("_") for n in VIEW_OPS)
    return f"weight loader applied op '{name}' to recording tensor of {src}: {why}; recordable ops: {allowed}"


def _freeze_index(index: Any) -> Any:
    """Indexing keys are kept as given (ints, slices, None, Ellipsis); lists are rejected as fancy indexing."""
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if not (item is None or item is Ellipsis or isinstance(item, (int, slice))):
            raise UnrecordableOpError(f"indexing a recording tensor with {item!r} (only ints, slices, None, ...)")
    return index


REFINE_LIMIT = 1 << 26
"""Source tensors with more elements than this are not searched for a strided view after a copying op."""


class Refined(NamedTuple):
    """One copy as two strided views over a common finer shape: where it reads (``src``) and writes (``dst``)."""

    src: StridedView
    dst: StridedView


def refine(shape: tuple[int, ...], chain: tuple[Op, ...], dst: StridedView) -> Refined | None:
    """(src, dst) over a common finer shape when the elements ``chain`` picks out of a tensor of ``shape`` form
    one strided view of it, else None. Found by replaying the chain on the tensor's element offsets and
    splitting each dim of the result into (size, stride) factors; checked exactly against the replay."""
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0 or numel > REFINE_LIMIT:
        return None
    x = replay(chain, torch.arange(numel, dtype=torch.int64).view(shape)).contiguous()
    if tuple(x.shape) != dst.shape or x.numel() == 0:
        return None
    base = int(x.reshape(-1)[0])
    sizes: list[int] = []
    src_strides: list[int] = []
    dst_strides: list[int] = []
    for d, step in enumerate(dst.stride):
        line = x[tuple(slice(None) if k == d else 0 for k in range(x.dim()))] - base
        factors = _factors(line.tolist())
        if factors is None:
            return None
        inner = 1
        outs = []
        for size, _ in reversed(factors):
            outs.append(step * inner)
            inner *= size
        sizes += [f[0] for f in factors]
        src_strides += [f[1] for f in factors]
        dst_strides += outs[::-1]
    src = StridedView(base, tuple(sizes), tuple(src_strides))
    if not torch.equal(src.apply(torch.arange(numel, dtype=torch.int64)), x.view(src.shape)):
        return None
    return Refined(src, StridedView(dst.offset, tuple(sizes), tuple(dst_strides)))


def _factors(line: list[int]) -> list[tuple[int, int]] | None:
    """Split offsets ``line`` (``line[0] == 0``) into (size, stride) factors, outermost first, if affine per factor."""
    out: list[tuple[int, int]] = []
    rest = line
    while len(rest) > 1:
        step = rest[1]
        run = 2
        while run < len(rest) and rest[run] == run * step:
            run += 1
        while len(rest) % run:
            run -= 1
        if run == 1:
            return None
        out.append((run, step))
        rest = rest[::run]
    return out[::-1] or [(1, 0)]


def dry_run(
    model: nn.Module,
    tensors: Iterable[TensorMeta],
    load: Callable[[Iterator[tuple[str, torch.Tensor]]], object],
) -> list[Capture]:
    """Run ``load`` (the engine's own loader, bound to ``model`` on meta) over recording tensors."""
    sink = RecordingSink(model)
    load((t.name, RecordingTensor.of(t, sink)) for t in tensors)
    return sink.captures
