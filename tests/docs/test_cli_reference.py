"""The docs site's CLI reference (docs/hooks/cli_reference.py) covers the Typer app's whole command tree."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import typer.main

from kvmove.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def _hook():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference() -> str:
    hook = _hook()
    page = (ROOT / "docs" / "cli.md").read_text()
    assert hook.MARKER in page
    return hook.on_page_markdown(page, None, SimpleNamespace(config_file_path=str(ROOT / "mkdocs.yml")), None)


def _commands(command, path):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, [*path, name])


def test_every_command_and_option_is_rendered():
    text = _reference()
    assert _hook().MARKER not in text
    for path, command in _commands(typer.main.get_command(app), ["kvmove"]):
        assert f"`{' '.join(path)}`" in text, path
        section = text.split(f"`{' '.join(path)}`\n", 1)[1]
        for param in command.params:
            if param.param_type_name == "option" and param.name != "help" and not param.hidden:
                assert f"`{param.opts[0]}`" in section.split("\n#")[0], (path, param.opts)


def test_choices_defaults_and_panels_come_from_the_app():
    text = _reference()
    sync = text.split("`kvmove sync-weights`\n", 1)[1].split("\n### ", 1)[0]
    assert "**Faults (run mode)**" in sync
    row = next(line for line in sync.splitlines() if line.startswith("| `--launcher`"))
    assert "`ray`, `processes`" in row and "| `ray` |" in row
    assert "```bash\nkvmove sync-weights --strategy v1,v2,v3,broadcast" in sync
