"""MkDocs hook: the CLI reference page, rendered at build time from kvmove's Typer app.

``docs/cli.md`` holds one marker line; this hook replaces it with every command of the app's command tree (usage,
help text, and per option panel: names, accepted values, default, help), so the reference cannot drift from the
code. It imports the tree the docs are built from (the repository root goes first on ``sys.path``).
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Any

MARKER = "<!-- kvmove-cli-reference -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    import typer.main

    from kvmove.cli.main import app

    command = typer.main.get_command(app)
    return markdown.replace(MARKER, "\n".join(_render(command, ["kvmove"], level=2)))


def _render(command: Any, path: list[str], level: int) -> list[str]:
    """One command's section (heading, usage, help, options), then its subcommands' one level down."""
    lines = [f"{'#' * level} `{' '.join(path)}`", ""]
    ctx = command.make_context(" ".join(path), [], resilient_parsing=True)
    usage = command.get_usage(ctx).replace(f"Usage: {path[-1]}", f"Usage: {' '.join(path)}", 1)
    lines += [f"```text\n{usage}\n```", ""]
    if command.help:
        lines += [_text(command.help), ""]
    subcommands = {name: sub for name, sub in getattr(command, "commands", {}).items() if not sub.hidden}
    if subcommands:
        lines += ["| command | what it does |", "|---|---|"]
        lines += [
            f"| [`{name}`](#{_anchor([*path, name])}) | {_cell(sub.get_short_help_str(100))} |"
            for name, sub in subcommands.items()
        ]
        lines.append("")
    lines += _params(command)
    for name, sub in subcommands.items():
        lines += _render(sub, [*path, name], level + 1)
    return lines


def _params(command: Any) -> list[str]:
    """The options and arguments, one table per help panel, in the order ``--help`` shows them."""
    panels: dict[str, list[Any]] = {}
    for param in command.params:
        if getattr(param, "hidden", False) or param.name == "help":
            continue
        panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(param)
    lines: list[str] = []
    for panel, params in panels.items():
        lines += [f"**{panel}**", "", "| option | values | default | help |", "|---|---|---|---|"]
        lines += [
            f"| {_names(p)} | {_cell(_values(p))} | {_cell(_default(p))} | {_cell(p.help or '')} |" for p in params
        ]
        lines.append("")
    return lines


def _names(param: Any) -> str:
    if param.param_type_name == "argument":
        return f"`{param.name.upper()}` (argument)"
    return ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])


def _values(param: Any) -> str:
    """The accepted values: an enum's members, a flag, or the option's metavar or type."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return ", ".join(f"`{member.value}`" for member in annotation)
    if getattr(param, "is_flag", False):
        return "flag"
    items = getattr(annotation, "__args__", None)  # list[str]: a repeatable option
    if param.metavar:
        metavar = param.metavar
    elif items:
        metavar = getattr(items[0], "__name__", "")
    else:
        metavar = getattr(annotation, "__name__", "")
    repeat = " (repeatable)" if getattr(param, "multiple", False) or items else ""
    return (f"`{metavar}`" if metavar else "") + repeat


def _default(param: Any) -> str:
    if getattr(param, "required", False):
        return "required"
    default = param.default
    if default is None or default == () or default == []:
        return ""
    if isinstance(default, enum.Enum):
        default = default.value
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"`{default}`"


def _anchor(path: list[str]) -> str:
    return "-".join(path).lower()


def _text(help_text: str) -> str:
    """Typer help text as Markdown: its paragraphs, each ``Example:`` paragraph a shell block."""
    out = []
    for paragraph in help_text.replace("\b\n", "").split("\n\n"):
        words = " ".join(paragraph.split())
        if words.startswith("Example: "):
            out.append(f"```bash\n{words.removeprefix('Example: ')}\n```")
        else:
            out.append(_escape(paragraph.strip()))
    return "\n\n".join(out)


def _escape(text: str) -> str:
    return text.replace("<", "&lt;")


def _cell(text: str) -> str:
    return _escape(" ".join(text.split())).replace("|", "\\|")
