"""The init of a host communicator (a mixin of communicator.py, like
membership.py: the state it reads is HostCommunicator's): meet the other
ranks in the store (``_rendezvous``: O(1) requests per rank), connect the
mesh (connect.MeshBuilder), agree on the broadcast algorithm; every step
within the init deadline, naming the ranks it did not hear from, and ended
soon after an abort (``_release_init``). A split's children skip the store:
the parent's mesh hands each its ``Bootstrap``.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ... import env
from ...errors import DistBackendError, DistStoreError
from ...store import Store
from ..base import CommConfig, CommState
from . import algorithms as alg
from .connect import MeshBuilder, listen
from .transport import Mesh
from .wire import MeshTimeoutError

# A rank's address in the store: token (rank 0's; zeros from the others), port, then the host.
_ADDR_RECORD = struct.Struct("<16sH")
_ALL_JOINED = b"all joined"
_EXPLAIN_CHECKS = 64  # store requests a timed-out rendezvous may spend finding who never joined


def host_address(store: Store) -> str:
    """The address peers should use to reach this rank: NCCL_PG_HOST_ADDR,
    else the local end of our connection to the store (the interface that
    reaches the other hosts), else loopback."""
    addr = env.HOST_ADDR.get()
    if addr:
        return addr
    inner = getattr(store, "underlying_store", store)
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    local_address = getattr(inner, "local_address", None)  # TCPStore's and EtcdStore's
    if callable(local_address):
        return str(local_address())
    return "127.0.0.1"


@dataclass
class Bootstrap:
    """What a new rank needs to join its mesh."""

    listener: socket.socket
    lower: dict[int, tuple[str, int]]
    token: bytes


class Bootstrapping:
    """Init of HostCommunicator (a mixin: the state it reads is HostCommunicator's)."""

    if TYPE_CHECKING:
        rank: int
        nranks: int
        name: str
        config: CommConfig
        _state: CommState
        _error: BaseException | None
        _mesh: Mesh | None
        _ready: threading.Event
        _lock: threading.Lock
        _token: bytes
        _rendezvous_store: Store | None
        _builder: MeshBuilder | None

    def _init(self, store: Store | None, boot: Bootstrap | None, deadline: float) -> None:
        """Every step has the init deadline, names the ranks it did not hear
        from, and ends soon after abort(): the store wait is woken through
        the store, the connections are cancelled, and the mesh is failed."""
        try:
            if boot is None:
                assert store is not None
                boot = self._rendezvous(store, deadline)
            self._token = boot.token
            builder = MeshBuilder(self.rank, self.nranks, boot.listener, boot.token, self.name)
            with self._lock:
                self._builder = builder
            try:
                if self._error is not None:  # aborted meanwhile: the build ends at once, closing what the builder holds
                    builder.cancel()
                socks = builder.build(boot.lower, deadline, self.config.timeout)
            finally:
                with self._lock:
                    self._builder = None
            mesh = Mesh(self.rank, self.nranks, socks, self.name, alg.WIRE_NAMES)
            with self._lock:
                if self._error is not None:  # aborted while connecting
                    mesh.close()
                    return
                self._mesh = mesh  # within abort's reach from here on
            mesh.tree_broadcast = self._agree_on_tree_broadcast(mesh, deadline)
            with self._lock:
                if self._error is None:
                    self._state = CommState.READY
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc if isinstance(exc, DistBackendError) else DistBackendError(
                        f"{self.name}: init failed on rank {self.rank}: {exc}")
                    self._state = CommState.ERROR
        finally:
            if boot is not None:
                boot.listener.close()
            self._ready.set()

    def _agree_on_tree_broadcast(self, mesh: Mesh, deadline: float) -> bool:
        """Every rank must run the same broadcast algorithm, but each one's
        preference depends on its own host (ranks vs CPUs) and environment:
        take the tree when any rank wants it."""
        algo = env.HOST_BROADCAST.get()
        votes = np.zeros(self.nranks, dtype=np.uint8)
        votes[self.rank] = algo == "tree" or (algo == "auto" and mesh.local_ranks > len(os.sched_getaffinity(0)))
        peers = [p for p in range(self.nranks) if p != self.rank]
        mine = alg.u8(votes[self.rank:self.rank + 1])
        try:
            mesh.exchange(alg.KIND["all_gather"], [(p, mine) for p in peers],
                          [(p, alg.u8(votes[p:p + 1]), None) for p in peers], deadline=deadline)
        except MeshTimeoutError as exc:
            raise MeshTimeoutError(
                f"timeout: {self.name}: rank {self.rank}: Timed out after {self.config.timeout:g} s waiting for ranks "
                f"{exc.missing} to finish the init handshake: they connected, then fell silent (frozen?)",
                exc.missing) from None
        return bool(votes.any())

    def _rendezvous(self, store: Store, deadline: float) -> Bootstrap:
        """O(1) store requests per rank, whatever the number of ranks: publish
        our address, count ourselves in (and mark that we did, unless we are
        the last, who says all joined instead: so a rank stopped between its
        count and its word can be named), wait for the last rank to say all
        joined (or an aborting rank to say it never will), then fetch the
        lower ranks' addresses in one request (the higher ones connect to us)."""
        listener = listen(host_address(store))
        try:
            host, port = listener.getsockname()[:2]
            token = os.urandom(16) if self.rank == 0 else bytes(16)
            with self._lock:
                if self._error is not None:
                    raise self._error
                self._rendezvous_store = store
            store.set(f"addr/{self.rank}", _ADDR_RECORD.pack(token, port) + host.encode())
            if store.add("joined", 1) == self.nranks:
                store.compare_set("all", b"", _ALL_JOINED)
            else:
                store.set(f"counted/{self.rank}", b"")
            try:
                store.wait(["all"], timeout=max(deadline - time.monotonic(), 0.001))
            except DistStoreError as exc:
                if self._error is not None:
                    raise self._error from None
                raise self._rendezvous_timeout(store, exc) from None
            verdict = store.get("all")
            if verdict != _ALL_JOINED:  # a rank aborted its init and woke everyone (see _wake_rendezvous): the
                # addresses of the ranks that never joined will not come
                raise self._error or DistBackendError(f"{self.name}: rank {self.rank}: init failed: "
                                                      f"{verdict.decode(errors='replace')}")
            values = store.multi_get([f"addr/{r}" for r in range(self.rank)])
        except BaseException:
            listener.close()
            raise
        finally:
            with self._lock:
                self._rendezvous_store = None
        lower = {}
        for r, record in enumerate(values):
            their_token, their_port = _ADDR_RECORD.unpack_from(record)
            lower[r] = (record[_ADDR_RECORD.size:].decode(), their_port)
            if r == 0:
                token = their_token
        return Bootstrap(listener, lower, token)

    def _rendezvous_timeout(self, store: Store, cause: DistStoreError) -> DistBackendError:
        """Name the ranks that never published their address, or else the
        ones that counted themselves in but went no further: bisections of
        ``check`` requests (a few per such rank, bounded), not one per rank;
        then what the store said (torch's words among ours, for log searches)."""
        said = f" (the store: {cause})"
        budget = [_EXPLAIN_CHECKS]

        def search(prefix: str, lo: int, hi: int, found: list[int]) -> list[int]:
            if budget[0] <= 0:
                return found
            budget[0] -= 1
            if store.check([f"{prefix}{r}" for r in range(lo, hi)]):
                return found
            if hi - lo == 1:
                found.append(lo)
                return found
            mid = (lo + hi) // 2
            search(prefix, lo, mid, found)
            return search(prefix, mid, hi, found)

        head = (f"timeout: {self.name}: rank {self.rank}: Timed out after {self.config.timeout:g} s waiting for "
                f"the other ranks to join the communicator")
        try:
            joined = store.add("joined", 0)
            absent = search("addr/", 0, self.nranks, [])
            # Everyone counted, yet nobody said so: the last to count (who has no mark) stopped before it could.
            silent = search("counted/", 0, self.nranks, []) if not absent and joined >= self.nranks else []
        except Exception as exc:  # the store itself may be gone; say what is known
            return DistBackendError(f"{head}; the store could not tell who is missing ({exc}){said}")
        more = " (and maybe others: the search stopped at its budget)" if budget[0] <= 0 else ""
        if len(silent) == 1:
            return DistBackendError(f"{head}: all {self.nranks} ranks counted themselves in, but rank {silent[0]} "
                                    f"counted itself in last but never announced that all had joined: it stopped "
                                    f"there (frozen, or killed during init?){said}")
        if silent:
            return DistBackendError(f"{head}: all {self.nranks} ranks counted themselves in, but ranks {silent}"
                                    f"{more} stopped right after (frozen, or killed during init?){said}")
        return DistBackendError(f"{head}: {joined} of {self.nranks} joined; ranks {absent}{more} never joined{said}")

    def _wake_rendezvous(self) -> None:
        """Abort during the store wait: end it now for every rank (none can
        finish without us) by marking the rendezvous aborted. On a thread of
        its own: abort() never waits for the store."""
        with self._lock:
            store = self._rendezvous_store
        if store is None:
            return
        why = f"rank {self.rank} aborted its init".encode()

        def wake() -> None:
            try:
                store.compare_set("all", b"", why)
            except Exception:  # the store is gone: the waits end at their deadline instead
                pass

        threading.Thread(target=wake, name=f"nccl_pg-abort-{self.name}", daemon=True).start()

    def _release_init(self) -> None:
        """An init still running ends now: its waiters are released at once
        and its thread soon after (the store wait woken, the connections
        cancelled; a mesh already built was failed by _fail)."""
        if self._ready.is_set():
            return
        self._wake_rendezvous()
        with self._lock:
            builder = self._builder
        if builder is not None:
            builder.cancel()
        self._ready.set()
