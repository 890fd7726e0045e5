"""Trainer (Megatron-style) and inference-engine parallel layouts, their rank coordinates and validation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from kvmove.errors import LayoutError
from kvmove.models.config import ModelConfig


def _parse(text: str, cls: type, what: str) -> dict[str, int]:
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in names:
            raise LayoutError(f"{what} layout {text!r}: {part!r} is not one of {', '.join(sorted(names))}=N")
        try:
            out[key] = int(value)
        except ValueError:
            raise LayoutError(f"{what} layout {text!r}: {key} must be an integer, got {value!r}") from None
        if out[key] < 1:
            raise LayoutError(f"{what} layout {text!r}: {key} must be >= 1")
    return out


def split_layers(num_layers: int, stages: int, extra_first: bool = True) -> list[range]:
    """Contiguous layer ranges per pipeline stage; the remainder goes to the first (or last-but-one) stages."""
    base, rem = divmod(num_layers, stages)
    sizes = [base] * stages
    order = range(rem) if extra_first else range(stages - 2, stages - 2 - rem, -1)
    for i in order:
        sizes[i % stages] += 1
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out


class TrainerCoord(NamedTuple):
    rank: int
    tp: int
    pp: int
    dp: int
    etp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class TrainerLayout:
    """Megatron-style: world = tp·pp·dp; inside a stage the tp·dp ranks also form etp × ep × edp for experts.

    Rank order is Megatron's default (tp fastest, then dp, then pp); expert ranks are etp-fastest.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1

    @classmethod
    def parse(cls, text: str) -> TrainerLayout:
        """``tp=4,pp=2,ep=8``; without ``dp``, the smallest dp whose tp·dp ranks ep·etp tiles (here 2)."""
        values = _parse(text, cls, "trainer")
        if "dp" not in values:
            tp, experts = values.get("tp", 1), values.get("ep", 1) * values.get("etp", 1)
            values["dp"] = math.lcm(tp, experts) // tp
        return cls(**values)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return (self.tp * self.dp) // (self.ep * self.etp)

    def coord(self, rank: int) -> TrainerCoord:
        tp, rest = rank % self.tp, rank // self.tp
        dp, pp = rest % self.dp, rest // self.dp
        local = tp + self.tp * dp
        etp, ep = local % self.etp, (local // self.etp) % self.ep
        return TrainerCoord(rank, tp, pp, dp, etp, ep, local // (self.etp * self.ep))

    def stage_ranks(self, pp: int) -> range:
        n = self.tp * self.dp
        return range(pp * n, (pp + 1) * n)

    def stage_layers(self, cfg: ModelConfig) -> list[range]:
        return split_layers(cfg.num_hidden_layers, self.pp, extra_first=True)

    def label(self) -> str:
        return f"tp={self.tp},pp={self.pp},ep={self.ep},etp={self.etp},dp={self.dp}"

    def validate(self, cfg: ModelConfig) -> None:
        """Raise LayoutError naming the first violated constraint."""
        _require(
            cfg.num_attention_heads % self.tp == 0,
            self,
            f"num_attention_heads ({cfg.num_attention_heads}) % tp",
        )
        if not cfg.is_mla:
            _require(
                cfg.num_key_value_heads % self.tp == 0,
                self,
                f"num_key_value_heads ({cfg.num_key_value_heads}) % tp (Megatron needs whole KV groups per TP rank)",
            )
        _require(cfg.vocab_size % self.tp == 0, self, f"vocab_size ({cfg.vocab_size}) % tp")
        _require(cfg.intermediate_size % self.tp == 0, self, f"intermediate_size ({cfg.intermediate_size}) % tp")
        _require(self.pp <= cfg.num_hidden_layers, self, f"pp <= num_hidden_layers ({cfg.num_hidden_layers})", "")
        if not cfg.is_moe:
            _require(self.ep == 1 and self.etp == 1, self, "ep == etp == 1 for a dense model", "")
            return
        _require(cfg.num_experts % self.ep == 0, self, f"num_experts ({cfg.num_experts}) % ep")
        _require(
            (self.tp * self.dp) % (self.ep * self.etp) == 0,
            self,
            f"tp·dp ({self.tp * self.dp}) % ep·etp ({self.ep * self.etp}) (experts tile each stage's ranks)",
        )
        _require(
            cfg.moe_intermediate_size % self.etp == 0,
            self,
            f"moe_intermediate_size ({cfg.moe_intermediate_size}) % etp",
        )
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        _require(shared % self.tp == 0, self, f"shared-expert intermediate size ({shared}) % tp")


class EngineCoord(NamedTuple):
    rank: int
    replica: int
    pp: int
    dp: int
    tp: int
    ep: int
    local: int
    """Rank within its replica; ranks with the same ``local`` hold identical parameters."""


@dataclass(frozen=True)
class EngineLayout:
    """One inference engine's layout (GPUs = tp·dp·pp) times ``replicas`` identical engines.

    vLLM's rule for experts: ep == 1 shards every expert over tp (replicated over dp); ep == tp·dp gives
    each rank whole experts (EP rank = dp·tp + tp rank). Attention is tp-sharded and dp-replicated.
    """

    tp: int = 1
    dp: int = 1
    ep: int = 1
    pp: int = 1
    replicas: int = 1

    @classmethod
    def parse(cls, text: str, replicas: int | None = None) -> EngineLayout:
        values = _parse(text, cls, "engine")
        if replicas is not None:
            values["replicas"] = replicas
        return cls(**values)

    @property
    def ranks_per_replica(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def world(self) -> int:
        return self.ranks_per_replica * self.replicas

    def coord(self, rank: int) -> EngineCoord:
        tp, rest = rank % self.tp, rank // self.tp
        dp, rest = rest % self.dp, rest // self.dp
        pp, replica = rest % self.pp, rest // self.pp
        ep = dp * self.tp + tp if self.ep > 1 else 0
        return EngineCoord(rank, replica, pp, dp, tp, ep, rank % self.ranks_per_replica)

    def stage_layers(self, cfg: ModelConfig) -> list[range]:
        """vLLM's split: the remainder goes to the stages just before the last."""
        return split_layers(cfg.num_hidden_layers, self.pp, extra_first=False)

    def label(self) -> str:
        """``tp=2,dp=1,ep=2,pp=1 x2``: the text rows and reports carry (read back by :func:`split_label`)."""
        return f"tp={self.tp},dp={self.dp},ep={self.ep},pp={self.pp} x{self.replicas}"

    def validate(self, cfg: ModelConfig) -> None:
        """Raise LayoutError naming the first violated constraint."""
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        _require(heads % self.tp == 0, self, f"num_attention_heads ({heads}) % tp")
        if not cfg.is_mla:
            ok = kv % self.tp == 0 or self.tp % kv == 0
            _require(ok, self, f"num_key_value_heads ({kv}) and tp: one must divide the other", "")
        _require(cfg.intermediate_size % self.tp == 0, self, f"intermediate_size ({cfg.intermediate_size}) % tp")
        _require(self.pp <= cfg.num_hidden_layers, self, f"pp <= num_hidden_layers ({cfg.num_hidden_layers})", "")
        if not cfg.is_moe:
            _require(self.ep == 1, self, "ep == 1 for a dense model", "")
            return
        _require(
            self.ep in (1, self.tp * self.dp),
            self,
            f"ep in (1, tp·dp = {self.tp * self.dp}) (vLLM's expert parallel)",
            "",
        )
        if self.ep == 1:
            moe = cfg.moe_intermediate_size
            _require(
                moe % self.tp == 0,
                self,
                f"moe_intermediate_size ({moe}) % tp (experts are tp-sharded when ep=1)",
            )
        else:
            _require(cfg.num_experts % self.ep == 0, self, f"num_experts ({cfg.num_experts}) % ep")
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        _require(shared % self.tp == 0, self, f"shared-expert intermediate size ({shared}) % tp")


def split_label(label: object) -> tuple[str, int]:
    """A layout label as rows carry it -> (its layout, its replicas): ``tp=2,dp=1,ep=2,pp=1 x2`` ->
    (``tp=2,dp=1,ep=2,pp=1``, 2), the text :meth:`EngineLayout.label` writes; a label without `` xN`` (a
    trainer's, or none) is one replica."""
    body, _, replicas = str(label or "").partition(" x")
    return body, int(replicas) if replicas.isdigit() else 1


def compact_label(label: object) -> str:
    """A layout label without its dimensions of 1, for tables and plots: ``tp=2,pp=2,ep=2,etp=1,dp=1`` ->
    ``tp=2,pp=2,ep=2``; ``tp=2,dp=1,ep=2,pp=1 x2`` -> ``tp=2,ep=2 x2``; all of 1 keeps the first."""
    body, replicas = split_label(label)
    dims = [p for p in body.split(",") if p]
    kept = [p for p in dims if not p.endswith("=1")] or dims[:1]
    return ",".join(kept) + (f" x{replicas}" if replicas != 1 else "")


def _require(ok: bool, layout: TrainerLayout | EngineLayout, constraint: str, suffix: str = " == 0") -> None:
    if not ok:
        who = "trainer" if isinstance(layout, TrainerLayout) else "engine"
        raise LayoutError(f"invalid {who} layout {layout.label()}: violates {constraint}{suffix}")
