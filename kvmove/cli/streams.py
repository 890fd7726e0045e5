"""Where a command's output goes: stdout holds only the command's own output (a table, or JSON lines with
``--json``); everything else -- progress, warnings, the logs of Ray, NIXL, UCX, uvicorn and vLLM, and any stray
print of a library or child process -- goes to stderr.

NIXL and UCX write from C++ straight to file descriptor 1, and child processes inherit it, so swapping
``sys.stdout`` is not enough: while a command runs, fd 1 points at stderr and the command writes its output to a
duplicate of the real stdout (:func:`out`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TextIO, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_out: TextIO | None = None


class OutputClosed(Exception):
    """stdout's reader went away (``kvmove ... | head``); not an OSError, so no CLI library handles it first."""


def out() -> TextIO:
    """The stream of the command's own output (the real stdout, also while fd 1 is routed to stderr)."""
    return _out if _out is not None else sys.stdout


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def reserve_stdout() -> Iterator[TextIO]:
    """Route fd 1 (and ``sys.stdout``) to stderr while inside; yield the real stdout for the command's output.

    Where stdout is not a file descriptor (a test's capture), only ``sys.stdout`` is swapped.
    """
    global _out
    real = sys.stdout
    fd, err = _fileno(real), _fileno(sys.stderr)
    if fd is None or err is None:
        _out, sys.stdout = real, sys.stderr
        try:
            yield real
        finally:
            sys.stdout, _out = real, None
        return
    real.flush()
    saved = os.dup(fd)
    os.dup2(err, fd)
    stream = open(saved, "w", buffering=1, encoding=real.encoding or "utf-8", errors="replace", closefd=True)  # noqa: SIM115
    _out = stream
    try:
        yield stream
    finally:
        _out = None
        for f in (stream, real):
            with suppress(OSError):  # a reader that went away (`| head`): nothing more can be written anyway
                f.flush()
        os.dup2(saved, fd)
        with suppress(OSError):
            stream.close()


def silence_stdout() -> None:
    """After stdout's reader went away: point fd 1 at /dev/null so exiting Python does not fail to flush it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass
    finally:
        os.close(devnull)


def owns_stdout(command: F) -> F:
    """Run a command's body inside :func:`reserve_stdout` (parsing, ``--help`` and usage errors stay outside)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with reserve_stdout():
                return command(*args, **kwargs)
        except BrokenPipeError:
            raise OutputClosed from None

    return wrapper  # type: ignore[return-value]


def _fileno(stream: TextIO) -> int | None:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    try:
        os.fstat(fd)
    except OSError:
        return None
    return fd


def note(message: str) -> None:
    """One line on stderr, prefixed ``kvmove:`` (warnings, notes, where rows went)."""
    print(f"kvmove: {message}", file=sys.stderr, flush=True)


@contextmanager
def progress() -> Iterator[Callable[[str], None]]:
    """A callable that reports progress on stderr: a transient spinner on a terminal, else plain timed lines
    (``kvmove: [  12.3s] v3: sync 2/3``), so piped and logged runs are never silent for long."""
    if not is_terminal(sys.stderr):
        start = time.monotonic()

        def line(message: str) -> None:
            note(f"[{time.monotonic() - start:7.1f}s] {message}")

        yield line
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("starting", total=None)
        yield lambda message: bar.update(task, description=message)
