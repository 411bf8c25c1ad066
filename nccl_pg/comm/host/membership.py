"""Changing a host communicator's membership without a fresh job: shrink
(drop ranks), revoke (stop what is in flight, keep the communicator for a
shrink), grow (take new ranks), with NCCL's semantics and call order
(ncclCommShrink, ncclCommRevoke, ncclCommGetUniqueId + ncclCommGrow).

The grow handshake. NCCL's coordinator gets a single-use id from its
communicator and sends it to the new ranks out of band; ncclCommGrow then
hands it to the existing ranks over the communicator's own bootstrap network
(v2.30.7-1 src/init.cc ncclCommGrow, src/bootstrap.cc bcastGrowHandle).
Here the id is a random nonce, the parent's size and the coordinator's
rank; ``grow`` gathers one small record per existing rank over the parent's
mesh (the size each asks for, the id it holds, the id it passed), so that
every rank takes the same decision, and refuses, on every rank alike, a grow
with no coordinator, two, or ranks that disagree. Then the old and new ranks
meet as a communicator's init does (``HostCommunicator._rendezvous``: four
store requests per rank, one parked wait, no polling, the init deadline)
under ``nccl_pg/grow/<nonce>/`` at the root of the job's store, which the
new ranks reach through the store they are given, whatever prefixes lie
between. Existing ranks keep their rank; new ones take ranks from the
parent's size up (NCCL's rule). An id whose grow has completed is refused.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...errors import DistBackendError
from ...store import PrefixStore, Store
from ..base import WAIT_READY_GRACE, CommConfig, CommState, Communicator, check_exclude

# magic, nonce, the parent's size, the coordinator's rank in it
_ID = struct.Struct("<8sI16sI")
_MAGIC = b"npg-grow"
_NO_ID = bytes(_ID.size)
# what each existing rank says in a grow: the size it asks for, the id it holds (coordinator), the id it passed
_GROW_RECORD = struct.Struct(f"<q{_ID.size}s{_ID.size}s")
_NAMESPACE = "nccl_pg/grow"
_SHOWN = 4  # ranks named in an error about disagreeing ranks


def _root(store: Store) -> Store:
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def _grow_store(store: Store, nonce: bytes) -> PrefixStore:
    return PrefixStore(f"{_NAMESPACE}/{nonce.hex()}", _root(store))


def parse_id(unique_id: object) -> tuple[bytes, int, int]:
    """(nonce, parent size, coordinator rank) of a host grow id; raises
    ValueError for anything else."""
    if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != _ID.size:
        raise ValueError(f"not a host-backend grow id (get_unique_id() gives {_ID.size} bytes): {unique_id!r:.80}")
    magic, parent_size, nonce, coordinator = _ID.unpack(bytes(unique_id))
    if magic != _MAGIC or parent_size < 1 or not 0 <= coordinator < parent_size:
        raise ValueError("not a host-backend grow id (from a HostCommunicator's get_unique_id())")
    return nonce, parent_size, coordinator


def join_store(store: Store, unique_id: bytes, nranks: int, rank: int) -> Store:
    """Where new rank ``rank`` of the grow named by ``unique_id`` meets the
    others; raises on an id or rank that breaks NCCL's rules, or an id whose
    grow has completed (one request)."""
    nonce, parent_size, _ = parse_id(unique_id)
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks <= parent_size:
        raise ValueError(f"a grow of a communicator of {parent_size} ranks needs a larger size, got nranks={nranks!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not parent_size <= rank < nranks:
        raise ValueError(f"a new rank of a grow from {parent_size} to {nranks} ranks takes a rank in "
                         f"{parent_size}..{nranks - 1} (the existing ranks keep theirs), got {rank!r}")
    meeting = _grow_store(store, nonce)
    if meeting.check(["all"]):
        raise DistBackendError(f"grow id {nonce.hex()[:12]}… was used already: a grow id is single-use "
                               "(ask the coordinator for a new one)")
    return meeting


class Membership:
    """Shrink, revoke and grow of HostCommunicator (a mixin: the state it
    reads is HostCommunicator's)."""

    supports_shrink = True
    supports_revoke = True
    supports_grow = True

    _pending_grow: bytes | None = None  # the coordinator's id, until a grow uses it
    _grow_count = 0

    if TYPE_CHECKING:
        rank: int
        nranks: int
        name: str
        config: CommConfig
        _store: Store | None
        _token: bytes
        _shrink_count: int

        @property
        def state(self) -> CommState: ...
        def wait_ready(self, timeout: float | None = None) -> None: ...
        def _usable(self) -> None: ...
        def _stop(self, state: CommState, why: str) -> None: ...
        def _gather_internal(self, mine: np.ndarray, timeout: float, what: str) -> np.ndarray: ...
        def _sibling(self, rank: int, nranks: int, config: CommConfig, name: str, store: Store) -> Communicator: ...

    def shrink(self, exclude: Sequence[int], config: CommConfig | None = None,
               abort_first: bool = False) -> Communicator:
        """The survivors meet again through the store (NCCL reuses its
        bootstrap network; ours is the store), under a key only this
        communicator's ranks know, so that the excluded ranks, dead or alive,
        are never waited for. Works on a communicator in error or revoked."""
        excluded = check_exclude(exclude, self.nranks, self.rank)
        if self.state is CommState.INITIALIZING:
            self.wait_ready(self.config.timeout + WAIT_READY_GRACE)
        if self.state is CommState.DESTROYED or self._store is None or not self._token:
            raise DistBackendError(f"{self.name}: cannot shrink a communicator that is {self.state.value}")
        if abort_first:
            self._stop(CommState.REVOKED, "in-flight operations stopped to shrink")
        self._shrink_count += 1
        survivors = [r for r in range(self.nranks) if r not in excluded]
        prefix = f"shrink/{self._token.hex()}/{self._shrink_count}/"
        return self._sibling(survivors.index(self.rank), len(survivors), config or self.config,
                             f"{self.name}.shrink{self._shrink_count}", PrefixStore(prefix, self._store))

    def revoke(self) -> None:
        self._stop(CommState.REVOKED, "communicator revoked")

    def get_unique_id(self) -> bytes:
        self._usable()
        if self.state is not CommState.READY:
            raise DistBackendError(f"{self.name}: get_unique_id() needs a ready communicator; this one is "
                                   f"{self.state.value}")
        if self._pending_grow is not None:
            raise DistBackendError(f"{self.name}: rank {self.rank} holds a grow id no grow has used yet: one id "
                                   "per grow (NCCL: 'Cannot generate a new UID while a previous UID is unconsumed')")
        self._pending_grow = _ID.pack(_MAGIC, self.nranks, os.urandom(16), self.rank)
        return self._pending_grow

    def grow(self, nranks: int, unique_id: bytes | None = None, config: CommConfig | None = None) -> Communicator:
        if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks <= self.nranks:
            raise ValueError(f"{self.name}: grow needs a size larger than {self.nranks}, got nranks={nranks!r}")
        if unique_id is not None:
            parse_id(unique_id)
        self._usable()
        if self._store is None or self.state is not CommState.READY:
            raise DistBackendError(f"{self.name}: cannot grow a communicator that is {self.state.value}")
        cfg = config or self.config
        mine = _GROW_RECORD.pack(nranks, self._pending_grow or _NO_ID, unique_id or _NO_ID)
        everyone = self._gather_internal(np.frombuffer(mine, dtype=np.uint8), cfg.timeout, "grow")
        records = [_GROW_RECORD.unpack_from(everyone.data, i * _GROW_RECORD.size) for i in range(self.nranks)]
        uid = self._agree(records, nranks)
        self._pending_grow = None  # used (on every rank alike: the decision above was everyone's)
        self._grow_count += 1
        nonce, _, _ = parse_id(uid)
        return self._sibling(self.rank, nranks, cfg, f"{self.name}.grow{self._grow_count}", _grow_store(self._store, nonce))

    def _agree(self, records: list[tuple[int, bytes, bytes]], nranks: int) -> bytes:
        """The grow id every rank takes, from every rank's record; the same
        error on every rank when there is none to take."""
        sizes = {r: size for r, (size, _, _) in enumerate(records)}
        if len(set(sizes.values())) > 1:
            shown = ", ".join(f"rank {r} asks for {n}" for r, n in list(sizes.items())[:_SHOWN])
            raise DistBackendError(f"{self.name}: grow: the ranks disagree on the new size ({shown})")
        held = {r: held for r, (_, held, _) in enumerate(records) if held != _NO_ID}
        if not held:
            raise DistBackendError(f"{self.name}: grow to {nranks} ranks: no rank called get_unique_id() first "
                                   "(one rank, the coordinator, must, and send the id to the new ranks)")
        if len(held) > 1:
            raise DistBackendError(f"{self.name}: grow: ranks {sorted(held)[:_SHOWN]} each called get_unique_id(); "
                                   "one coordinator per grow")
        coordinator, uid = next(iter(held.items()))
        wrong = [r for r, (_, _, passed) in enumerate(records) if passed not in (_NO_ID, uid)]
        if wrong:
            raise DistBackendError(f"{self.name}: grow: ranks {wrong[:_SHOWN]} passed a grow id that is not the one "
                                   f"rank {coordinator} (the coordinator) got from this communicator")
        return uid
