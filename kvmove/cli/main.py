"""The kvmove command line: a table of contents; each command lives in its own module.

Exit codes (every command): 0 success; 1 the job ran and failed (JobFailed); 2 bad usage or bad input, one line on
stderr (KvmoveError, or whatever usage error the CLI library raises); 130 interrupted, after cleanup; 141 (quietly)
when stdout's reader went away (``| head``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Annotated, NamedTuple

import typer

from kvmove import __version__
from kvmove.cli import bench, check, migrate, models, serve, streams, sync
from kvmove.errors import JobFailed, KvmoveError

OK, FAILED, USAGE, INTERRUPTED, BROKEN_PIPE = 0, 1, 2, 130, 141

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(models.app, name="models")
app.command("sync-weights")(streams.owns_stdout(sync.sync_weights))
app.add_typer(bench.app, name="bench")
app.command("serve")(streams.owns_stdout(serve.serve))
app.command("migrate")(streams.owns_stdout(migrate.migrate))
app.add_typer(check.app, name="check")


def _print_version(value: bool) -> None:
    if value:
        print(f"kvmove {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print kvmove's version and exit."),
    ] = False,
) -> None:
    """Move model state in RL post-training (weight sync, KV-cache migration) and measure it.

    Exit codes: 0 success, 1 the job ran and failed, 2 bad usage or input, 130 interrupted.

    Example: kvmove sync-weights --strategy v1,v2,v3,broadcast --syncs 2 --verify

    Example: kvmove bench report --format markdown
    """


def run(argv: Sequence[str] | None = None) -> int:
    """Run one command line; return its exit code. Known errors become one line on stderr, never a traceback."""
    usage_error, abort = _cli_errors()
    try:
        code = app(args=list(argv) if argv is not None else None, prog_name="kvmove", standalone_mode=False)
    except JobFailed as exc:
        return _fail(FAILED, f"failed: {exc}")
    except KvmoveError as exc:
        return _fail(USAGE, f"error: {exc}")
    except usage_error as exc:
        return _fail(USAGE, f"error: {_usage_message(exc)}")
    except typer.Exit as exc:
        code = exc.exit_code
    except abort as exc:
        interrupted = isinstance(exc.__cause__, KeyboardInterrupt)
        return _fail(INTERRUPTED if interrupted else FAILED, "interrupted" if interrupted else "aborted")
    except KeyboardInterrupt:
        return _fail(INTERRUPTED, "interrupted")
    except (streams.OutputClosed, BrokenPipeError):  # `kvmove ... | head`: the shell's code for it, no noise
        streams.silence_stdout()
        return BROKEN_PIPE
    # NOTE: typer returns, not raises, exit codes in non-standalone mode (typer.Exit(1), 130 on Ctrl-C)
    code = code if isinstance(code, int) else OK
    if code == INTERRUPTED:
        streams.note("interrupted")
    return code


def main() -> None:
    """Console-script entry point."""
    sys.exit(run())


def _fail(code: int, message: str) -> int:
    streams.note(" ".join(message.split()))
    return code


class CliErrors(NamedTuple):
    """The CLI library's usage-error and abort classes."""

    usage: type[Exception]
    abort: type[Exception]


def _cli_errors() -> CliErrors:
    """The usage-error and abort classes of the click that this typer uses (typer >= 0.24 vendors its own)."""
    click_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    return CliErrors(click_error, typer.Abort)


def _usage_message(exc: Exception) -> str:
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    ctx = getattr(exc, "ctx", None)
    where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return f"{message}{where}"


if __name__ == "__main__":
    main()
