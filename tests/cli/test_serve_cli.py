"""`kvmove serve` refuses what it can check up front with one line and exit 2, before it builds a model, touches
NIXL or allocates a pool."""

from __future__ import annotations

import sys

import pytest

from kvmove.cli.main import main

pytest.importorskip("fastapi")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-pages", "1000000000"], "KV pools need"),
        (["--host-pages", "1000000000", "--enable-kv-migration"], "host pool 1000000000 pages"),
        (["--dtype", "float16"], "'float16' is not one of 'float32', 'bfloat16'"),
        (["--allowed-peers", "http://10.0.0.2:30001/x"], "is not host:port"),
        (["--allowed-peers", "10.0.0.2:30001,evil.example:80#x"], "is not host:port"),
        (["--migration-share", "1.5"], "migration-share must be in (0, 1]"),
        (["--host", "not a host"], "host must be an IPv4 address"),
        (["--hold-timeout", "0"], "timeouts > 0 seconds"),
    ],
)
def test_bad_serve_options_are_one_line_before_anything_is_built(monkeypatch, capsys, args, message) -> None:
    import kvmove.server.runtime as runtime

    def never(*_: object, **__: object) -> None:
        raise AssertionError("the server was being built")

    monkeypatch.setattr(runtime.Runtime, "__init__", never)
    monkeypatch.setattr(sys, "argv", ["kvmove", "serve", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_nixl_needs_a_host_address_of_this_machine(monkeypatch, capsys) -> None:
    from kvmove.transport import NixlTransport

    if not NixlTransport.is_available():
        pytest.skip("NIXL is not installed")
    args = ["serve", "--enable-kv-migration", "--host", "192.0.2.254", "--admin-api-key", "k"]  # NOTE: off loopback
    monkeypatch.setattr(sys, "argv", ["kvmove", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    refused = ("no network interface of this host carries '192.0.2.254'", "cannot listen on 192.0.2.254")
    assert exit_.value.code == 2 and any(r in err for r in refused), err
    assert len(err.strip().splitlines()) == 1
