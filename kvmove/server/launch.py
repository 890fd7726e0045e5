"""Running servers: in the foreground (``kvmove serve``), in a thread of this process (tests), or as loopback
subprocesses (the migration controller), each bounded in time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import IO, Any

import httpx
import uvicorn

from kvmove.errors import KvmoveError
from kvmove.server.app import create_app
from kvmove.server.config import SECRET_FIELDS, ServerConfig
from kvmove.server.listen import listen
from kvmove.server.runtime import Runtime


def serve(config: ServerConfig, ready: Callable[[str], None] | None = None, sock: socket.socket | None = None) -> None:
    """Run one server until interrupted. The port is taken before the model is built (a port in use is a
    KvmoveError, nothing built; ``sock``: already taken); ``ready(url)`` is called once the server accepts
    requests (port 0: the port the OS picked)."""
    sock = sock or listen(config.host, config.port)
    config = replace(config, port=int(sock.getsockname()[1]))
    try:
        rt = Runtime(config)
        rt.start()
        try:
            server = uvicorn.Server(http_config(create_app(rt), config))
            if ready is not None:
                threading.Thread(target=_announce, args=(server, config.url, ready), daemon=True).start()
            server.run(sockets=[sock])
        finally:
            rt.stop()
    finally:
        sock.close()


def http_config(app: Any, config: ServerConfig, **where: Any) -> uvicorn.Config:
    """uvicorn's settings for a server: idle keep-alive connections closed after ``keep_alive_timeout``, at most
    ``max_connections`` connections or requests at once (beyond: 503), warnings only (``where``: host and port when
    uvicorn binds the socket itself)."""
    return uvicorn.Config(
        app,
        log_level="warning",
        timeout_keep_alive=config.keep_alive_timeout,
        limit_concurrency=config.max_connections,
        **where,
    )


def _announce(server: uvicorn.Server, url: str, ready: Callable[[str], None]) -> None:
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    ready(url)


class ServerThread:
    """A server in a thread of this process; ``runtime`` is inspectable (integrity, pending migrations)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.runtime = Runtime(config)
        self._server = uvicorn.Server(http_config(create_app(self.runtime), config, host=config.host, port=config.port))
        self._thread = threading.Thread(target=self._server.run, name=f"uvicorn-{config.port}", daemon=True)

    @property
    def url(self) -> str:
        return self.config.url

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.runtime.start()
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise KvmoveError(f"server on {self.url} did not start within {timeout:.0f} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.runtime.stop()


def serve_args(config: ServerConfig) -> list[str]:
    """``kvmove serve`` flags reproducing ``config``, but its keys (``serve_env`` passes those)."""
    args = []
    for f in fields(config):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name in SECRET_FIELDS:
            continue
        if isinstance(value, bool):  # NOTE: on/off pairs: a True default is turned off by --no-<name>
            if value != f.default:
                args += [flag if value else "--no-" + flag[2:]]
        elif isinstance(value, tuple):
            args += [flag, ",".join(value)] if value else []
        else:
            args += [flag, str(value)]
    return args


def serve_env(config: ServerConfig) -> dict[str, str]:
    """The environment of a ``kvmove serve`` child: ours plus its keys (never on a command line others can read)."""
    env = dict(os.environ)
    for name in SECRET_FIELDS:
        value = getattr(config, name)
        if value:
            env[f"KVMOVE_{name.upper()}"] = value
    return env


def spawn(config: ServerConfig, log: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """Start ``kvmove serve`` as a subprocess (bound to ``config.host``, loopback by default)."""
    cmd = [sys.executable, "-m", "kvmove.cli.main", "serve", *serve_args(config)]
    out = log or subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=out, stderr=log or subprocess.STDOUT, env=serve_env(config))


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise KvmoveError(f"server {url} exited with code {proc.returncode}: {tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise KvmoveError(f"server {url} not healthy within {timeout:.0f} s")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


class LocalCluster:
    """``n`` ``kvmove serve`` subprocesses on loopback ports (logs in ``log_dir``); stopped on exit."""

    def __init__(self, configs: list[ServerConfig], log_dir: Path, start_timeout: float = 90.0) -> None:
        self.configs, self.log_dir, self.start_timeout = configs, log_dir, start_timeout
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.configs]

    def __enter__(self) -> LocalCluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for c in self.configs:
                with open(self.log_dir / f"serve-{c.port}.log", "wb") as log:
                    self.procs.append(spawn(c, log))
            for c, p in zip(self.configs, self.procs, strict=True):
                wait_healthy(c.url, p, self.start_timeout, self.log_dir / f"serve-{c.port}.log")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            stop_process(p)
