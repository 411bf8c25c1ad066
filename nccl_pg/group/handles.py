"""Init handles and the plan of a reconfigure (torchcomms' shape:
``get_init_handle()``, ``reconfigure(uuid, init_handles, timeout)``).

A handle names one process and where it stands: ``nccl_pg:<uuid>:<rank>:<token>``
— the configuration it is in (the uuid its group was created or last
reconfigured with; -1: none), its rank there (-1: none) and a token of the
process. Every process of the next configuration is given the same handles;
from them each computes the same plan, with no communication:

- the quorum: the configuration most handles come from (ties: the newest
  uuid); its processes are the members, the others join;
- the members keep their order (new ranks 0..m-1, in the order of their old
  ranks: a shrink's numbering); the members' old ranks not named left;
- the new processes take ranks m, m+1, ... in the order of ``init_handles``
  (a list), or of the handles' text (a set: every process sees the same
  order, whatever its hash seed) — NCCL's rule for a grow: new ranks come
  after the existing ones.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

_PREFIX = "nccl_pg"
_HANDLE = re.compile(r"nccl_pg:(-1|\d+):(-1|\d+):([0-9a-f]{16})\Z")
_token: tuple[int, str] | None = None  # (pid, token): a forked child makes its own


def process_token() -> str:
    """This process's token (16 hex digits; a forked child gets a new one)."""
    global _token
    pid = os.getpid()
    if _token is None or _token[0] != pid:
        _token = (pid, secrets.token_hex(8))
    return _token[1]


@dataclass(frozen=True)
class Handle:
    uuid: int  # the configuration the process is in, -1: none
    rank: int  # its rank there, -1: none
    token: str

    def __str__(self) -> str:
        return f"{_PREFIX}:{self.uuid}:{self.rank}:{self.token}"

    @classmethod
    def parse(cls, text: object, where: str) -> Handle:
        if not isinstance(text, str):
            raise TypeError(f"{where} must be a str (from get_init_handle()), got {type(text).__name__}: {text!r:.80}")
        m = _HANDLE.match(text)
        if m is None:
            raise ValueError(f"{where} {text!r:.120} is not an nccl_pg init handle (from get_init_handle(): "
                             f"'{_PREFIX}:<uuid>:<rank>:<token>')")
        uuid, rank = int(m.group(1)), int(m.group(2))
        if (uuid < 0) != (rank < 0):
            raise ValueError(f"{where} {text!r}: a handle has both a uuid and a rank, or neither")
        return cls(uuid, rank, m.group(3))


def handle_for(uuid: int | None, rank: int | None) -> str:
    """This process's handle: in configuration ``uuid`` at ``rank``, or in none."""
    if uuid is None or rank is None:
        return str(Handle(-1, -1, process_token()))
    return str(Handle(uuid, rank, process_token()))


def check_uuid(uuid: object) -> int:
    if isinstance(uuid, bool) or not isinstance(uuid, int):
        raise TypeError(f"reconfigure: uuid must be an int, got {type(uuid).__name__}: {uuid!r}")
    if uuid < 0:
        raise ValueError(f"reconfigure: uuid must be >= 0, got {uuid}")
    return uuid


@dataclass(frozen=True)
class Plan:
    """What a reconfigure does, the same on every process given the same handles."""

    uuid: int
    quorum: int | None  # the configuration the members come from (None: nobody is in one; all start afresh)
    survivors: tuple[int, ...]  # the members' ranks in the quorum, in order: their new ranks are 0..m-1
    joiners: tuple[str, ...]  # the new processes' handles, in the order of their new ranks m..
    rank: int  # this process's new rank
    member: bool  # this process is in the quorum (else it joins)
    digest: str  # of the whole plan: ranks given different handles find out

    @property
    def size(self) -> int:
        return len(self.survivors) + len(self.joiners)

    def left(self, old_size: int) -> list[int]:
        """The quorum's ranks not in the new configuration (a member's view)."""
        return [r for r in range(old_size) if r not in self.survivors]


def _ordered(init_handles: object) -> list[object]:
    if isinstance(init_handles, (list, tuple)):
        return list(init_handles)
    if isinstance(init_handles, (set, frozenset)):
        return sorted(init_handles, key=str)
    raise TypeError(f"reconfigure: init_handles must be a list or a set of handles, got "
                    f"{type(init_handles).__name__}")


def make_plan(uuid: object, init_handles: object, mine: str, current_size: int | None) -> Plan:
    """The plan for this process (handle ``mine``, in a group of
    ``current_size`` ranks or in none); raises TypeError/ValueError naming
    what is wrong with the arguments."""
    uuid = check_uuid(uuid)
    texts = _ordered(init_handles)
    if not texts:
        raise ValueError("reconfigure: init_handles is empty: the new configuration needs at least this process")
    handles = [Handle.parse(t, f"init_handles[{i}]") for i, t in enumerate(texts)]
    _check_distinct(texts, handles)
    me = Handle.parse(mine, "this process's handle")
    if me not in handles:
        raise ValueError(f"reconfigure: this process's handle {mine!r} is not in init_handles (a process that "
                         "leaves does not call reconfigure; one that stays or joins is in the list)")
    if any(h.uuid == uuid for h in handles):
        raise ValueError(f"reconfigure: uuid {uuid} is the configuration some handles are from; each reconfigure "
                         "takes a uuid never used before")
    counts = Counter(h.uuid for h in handles if h.uuid >= 0)
    quorum = max(counts, key=lambda u: (counts[u], u)) if counts else None
    members = sorted((h for h in handles if h.uuid == quorum), key=lambda h: h.rank)
    joiners = [h for h in handles if h.uuid != quorum]
    member = me.uuid == quorum
    if member and current_size is not None:
        beyond = [h.rank for h in members if h.rank >= current_size]
        if beyond:
            raise ValueError(f"reconfigure: init_handles name ranks {beyond} of configuration {quorum}, which has "
                             f"{current_size} ranks")
    order = members + joiners
    digest = hashlib.sha256(f"{uuid}|{quorum}|{','.join(map(str, order))}".encode()).hexdigest()[:16]
    return Plan(uuid, quorum, tuple(h.rank for h in members), tuple(str(h) for h in joiners), order.index(me),
                member, digest)


def _check_distinct(texts: Iterable[object], handles: list[Handle]) -> None:
    seen: dict[str, int] = {}
    for i, t in enumerate(texts):
        if t in seen:
            raise ValueError(f"reconfigure: init_handles[{i}] {t!r} is init_handles[{seen[str(t)]}] again")
        seen[str(t)] = i
    tokens = Counter(h.token for h in handles)
    twice = [t for t, n in tokens.items() if n > 1]
    if twice:
        raise ValueError(f"reconfigure: init_handles holds two handles of one process (token {twice[0]}): "
                         "each process gives one handle")
    ranks = Counter((h.uuid, h.rank) for h in handles if h.uuid >= 0)
    clash = [k for k, n in ranks.items() if n > 1]
    if clash:
        raise ValueError(f"reconfigure: two handles claim rank {clash[0][1]} of configuration {clash[0][0]}")
