"""The kvmove command line: a table of contents; each command lives in its own module."""

from __future__ import annotations

import sys

import typer

from kvmove.cli import bench, migrate, models, serve, sync
from kvmove.errors import KvmoveError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Move model state in RL post-training (weight sync, KV-cache migration) and measure it.",
)
app.add_typer(models.app, name="models")
app.command("sync-weights")(sync.sync_weights)
app.add_typer(bench.app, name="bench")
app.command("serve")(serve.serve)
app.command("migrate")(migrate.migrate)


def main() -> None:
    """Entry point: user mistakes become one line on stderr and exit code 2, never a traceback."""
    try:
        app(standalone_mode=False)
    except KvmoveError as exc:
        print(f"kvmove: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("kvmove: aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
