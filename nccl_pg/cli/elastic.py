"""`nccl-pg run --elastic`: a rank that dies is replaced, and the job goes on.

The launcher is the membership authority of nccl_pg.elastic's protocol: it
sees every death (it reaps the ranks) and starts every replacement, so it
writes the membership records the ranks follow. At start, record 0 (ranks
0..N-1; each rank's member number is its rank, ``NCCL_PG_ELASTIC_MEMBER``).
When member d of record u dies: record u+1 without it (the survivors
shrink), and, while replacements are left (``--max-replacements``), record
u+2 with a new member added, whom it starts with ``NCCL_PG_ELASTIC_UUID=u+2``
(the survivors grow to take it in); the replacement gets the dead rank's
LOCAL_RANK (its GPU) and no RANK (its rank comes from the grow). Both
records go in one store request. The store lives in the launcher, so no
death, rank 0's included, loses it. With no replacement left, a death stops
the job as without --elastic.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .. import env
from ..elastic import Config, publish
from ..store import TCPStore

DEFAULT_MAX_REPLACEMENTS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--elastic", action="store_true",
                        help="replace a rank that dies with a new process, which the others take in "
                             "(nccl_pg.elastic; docs/ELASTIC.md)")
    parser.add_argument("--max-replacements", type=_count, default=DEFAULT_MAX_REPLACEMENTS, metavar="N",
                        help="with --elastic: start at most N replacements in the whole job, then a death stops the "
                             f"job (default: {DEFAULT_MAX_REPLACEMENTS})")


def _count(raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {raw!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class Replacement:
    """A process to start in place of a dead member."""

    member: int
    uuid: int  # the configuration it joins
    local_rank: int  # the dead member's (its GPU)

    def env(self) -> dict[str, str]:
        return {env.ELASTIC_MEMBER.name: str(self.member), env.ELASTIC_UUID.name: str(self.uuid),
                "LOCAL_RANK": str(self.local_rank)}


class Records:
    """The launcher's records: who is in, and what to start when one dies."""

    def __init__(self, nproc: int, max_replacements: int, addr: str, port: int, secret: str | None,
                 timeout: float = 30.0) -> None:
        self.members = list(range(nproc))
        self.local_rank = {m: m for m in self.members}
        self.uuid = 0
        self.replacements_left = max_replacements
        self._next_member = nproc
        self._store = TCPStore(addr, port, is_master=False, timeout=timeout, secret=secret)
        publish(self._store, [Config(0, tuple(self.members))])

    @staticmethod
    def rank_env(rank: int) -> dict[str, str]:
        return {env.ELASTIC_MEMBER.name: str(rank)}

    def died(self, member: int) -> Replacement | None:
        """Member ``member`` died: the records without it and, while any is
        left, with a replacement; the replacement to start (None: no
        replacement left, the job must stop; nothing is written then)."""
        if member not in self.members or self.replacements_left == 0:
            return None
        self.replacements_left -= 1
        self.members.remove(member)
        shrunk = Config(self.uuid + 1, tuple(self.members))
        new = self._next_member
        self._next_member += 1
        self.members.append(new)
        self.local_rank[new] = self.local_rank.pop(member)
        grown = Config(self.uuid + 2, tuple(self.members))
        self.uuid = grown.uuid
        publish(self._store, [shrunk, grown])
        return Replacement(new, grown.uuid, self.local_rank[new])

    def close(self) -> None:
        self._store.close()
