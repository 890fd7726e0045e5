import socket

import pytest

from kvmove import ports


def test_free_port_lies_below_the_ephemeral_range_and_is_bindable() -> None:
    low = ports.ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert 20000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports.random, "sample", lambda population, k: [busy] * k)
        port = ports.free_port()  # every low candidate busy: the kernel's pick
        assert port != busy
        assert port >= ports.ephemeral_low()
