"""The control plane's wire: typed commands by address, authenticated, answered in order, errors as one line."""

from __future__ import annotations

import threading
import time

import pytest

from kvmove.errors import KvmoveError
from kvmove.sync.ranks.control import Finish, Pack, Packed
from kvmove.sync.ranks.wire import ControlClient, ControlServer, RankUnreachable, RemoteError

KEY = b"k" * 32


class Trainer:
    """Answers Pack after a delay chosen per pull; records Finish notes."""

    def __init__(self) -> None:
        self.notes: list[Finish] = []
        self.noted = threading.Event()

    def handle(self, command: object) -> object:
        if isinstance(command, Finish):
            self.notes.append(command)
            self.noted.set()
            return None
        assert isinstance(command, Pack)
        if command.pull_id < 0:
            raise KvmoveError(f"engine rank {command.engine} never registered pull {command.pull_id}")
        if command.pull_id == 99:
            raise ZeroDivisionError("boom\nsecond line")
        time.sleep(0.05 if command.pull_id == 0 else 0)
        return Packed(command.pull_id, 16 * command.pull_id)


@pytest.fixture()
def server():
    trainer = Trainer()
    srv = ControlServer(trainer.handle, "127.0.0.1", KEY)
    yield srv, trainer
    srv.close()


def test_replies_are_typed_and_in_request_order(server) -> None:
    srv, _ = server
    client = ControlClient(srv.address, KEY, "trainer rank 0")
    for pull in (0, 1, 2):  # the first is answered last by the handler's clock, but replies keep request order
        client.send(Pack(1, "v3", 0, pull, 5.0))
    assert [client.receive() for _ in range(3)] == [Packed(0, 0), Packed(1, 16), Packed(2, 32)]
    client.close()


def test_notes_are_not_answered_and_do_not_wait_for_packs(server) -> None:
    srv, trainer = server
    packs, notes = (ControlClient(srv.address, KEY, "trainer rank 0") for _ in range(2))
    packs.send(Pack(1, "v3", 0, 0, 5.0))
    notes.send(Finish(1, "v3", group=4, engine=0, slot=1))
    assert trainer.noted.wait(5) and trainer.notes == [Finish(1, "v3", 4, 0, 1)]
    assert packs.receive() == Packed(0, 0)
    with pytest.raises(RankUnreachable, match="did not answer within 0 s"):
        notes.receive(timeout_s=0.2)  # nothing comes back for a note


def test_errors_come_back_as_one_line(server) -> None:
    srv, _ = server
    client = ControlClient(srv.address, KEY, "trainer rank 3")
    with pytest.raises(KvmoveError, match=r"^engine rank 0 never registered pull -1$"):
        client.call(Pack(1, "v3", 0, -1, 5.0))
    with pytest.raises(RemoteError, match=r"^trainer rank 3: ZeroDivisionError: boom$"):
        client.call(Pack(1, "v3", 0, 99, 5.0))
    assert client.call(Pack(1, "v3", 0, 1, 5.0)) == Packed(1, 16)  # the connection survives a failed command


def test_a_peer_without_the_run_key_is_refused(server) -> None:
    srv, _ = server
    with pytest.raises(RankUnreachable, match="refused this process's key"):
        ControlClient(srv.address, b"x" * 32, "trainer rank 0")
    assert ControlClient(srv.address, KEY, "trainer rank 0").call(Pack(1, "v3", 0, 1, 5.0)) == Packed(1, 16)


def test_a_gone_rank_is_one_clear_error(server) -> None:
    srv, _ = server
    client = ControlClient(srv.address, KEY, "trainer rank 0")
    srv.close()
    client.close()
    with pytest.raises(RankUnreachable, match=r"trainer rank 0 at 127\.0\.0\.1:[0-9]+ is unreachable"):
        ControlClient(srv.address, KEY, "trainer rank 0")
