"""Which options apply to which mode of a command. An option given explicitly (command line or environment) in a
mode it does not apply to is refused in one line: a flag silently ignored is a bug the user never sees."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import typer

from kvmove.errors import KvmoveError

_EXPLICIT = ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def explicit_options(ctx: typer.Context) -> list[str]:
    """Names of the parameters the user set (not left at their defaults), in declaration order."""
    names = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if source is not None and source.name in _EXPLICIT:
            names.append(str(param.name))
    return names


def flag(ctx: typer.Context, name: str) -> str:
    """The option's first spelling, e.g. ``--fail-engine`` for ``fail_engine``."""
    param = next((p for p in ctx.command.params if p.name == name), None)
    return str(param.opts[0]) if param is not None and param.opts else f"--{name.replace('_', '-')}"


def check_options(ctx: typer.Context, mode: str, applies: Mapping[str, Collection[str]]) -> None:
    """Refuse every explicit option whose modes (``applies``; absent: every mode) exclude ``mode``."""
    for name in explicit_options(ctx):
        modes = applies.get(name)
        if modes is not None and mode not in modes:
            where = ", ".join(m for m in applies_order(applies) if m in modes)
            raise KvmoveError(f"{flag(ctx, name)} does not apply to {mode} (only to: {where})")


def applies_order(applies: Mapping[str, Collection[str]]) -> list[str]:
    """Every mode named in ``applies``, in first-seen order (for stable messages)."""
    seen: dict[str, None] = {}
    for modes in applies.values():
        for m in modes:
            seen.setdefault(m, None)
    return list(seen)
