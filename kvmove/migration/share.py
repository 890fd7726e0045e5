"""How much of a pool migrations may hold: one migration at most ``migration`` of it, the migrations of one peer
together at most ``peer`` of it, so no single caller can starve generation or every other peer by allocating."""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.migration.errors import ShareExceededError


@dataclass(frozen=True)
class PoolShare:
    migration: float = 0.5
    peer: float = 0.5

    def check(self, pages: int, peer_pages: int, pool_pages: int, peer: str, pool: str) -> None:
        """ShareExceededError unless ``pages`` more (``peer`` holding ``peer_pages`` already) fit the shares of a
        ``pool_pages``-page ``pool``."""
        one = int(self.migration * pool_pages)
        if pages > one:
            raise ShareExceededError(
                f"one migration may hold at most {one} pages ({self.migration:.0%}) of the {pool}, asked for {pages}"
            )
        cap = int(self.peer * pool_pages)
        if peer_pages + pages > cap:
            raise ShareExceededError(
                f"peer {peer or '?'} holds {peer_pages} pages of the {pool} in pending migrations; {pages} more "
                f"would exceed its share of {cap} ({self.peer:.0%}): commit or abort those first"
            )
