"""A group's point-to-point communicators with one peer each.

A send or receive issued before the group has its communicator must not
wait for ranks that take no part in it: three ranks whose first operation is
``send 0->1`` while rank 2 is busy elsewhere (a pipeline's start, torchft's
checkpoint transfer right after a quorum). ProcessGroupNCCL builds a
communicator for the pair (keyed "lo:hi", at the first unbatched send or
receive between them in lazy mode); so does a group here, on every backend
(on the host backend it is a two-rank mesh: one connection). Such a
communicator serves that pair's standalone sends and receives issued before
the group's own communicator exists; from then on they go to the group's
(which waits, once, for what the pairs still run), so their order with the
group's collectives is the group's. Batched point-to-point
(``batch_isend_irecv``, coalescing), receives from any source and a
two-rank group use the group's communicator, as ProcessGroupNCCL's batches do.
The operation that creates a pair communicator waits for it (NCCL's
operations must), and fails at the group's timeout naming the peer that
never joined. Backends that connect every rank at a group's creation (the
host backend, as Gloo: ``Backend.connects_at_creation``) need no pairs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..comm.base import CommState, Communicator, Stream
from ..errors import DistBackendError


class Pairs:
    """The pair communicators of one group, by peer (group rank)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._lock = threading.Lock()
        self._by_peer: dict[int, tuple[Communicator, Stream]] = {}
        self._making: dict[int, threading.Lock] = {}
        self.creating: list[Communicator] = []  # inits in progress (within abort()'s reach)

    def get(self, peer: int, create: Callable[[int], tuple[Communicator, Stream]]) -> tuple[Communicator, Stream]:
        """``peer``'s pair communicator and its stream, made by ``create(peer)`` (blocking) the first time.
        (The group passes ``create`` each time: held here, a bound method would make a cycle that keeps a
        dropped group, its threads and sockets, until the garbage collector runs.)"""
        found = self._by_peer.get(peer)
        if found is not None:
            return found
        with self._lock:  # (held briefly: abort() takes it)
            making = self._making.setdefault(peer, threading.Lock())
        with making:  # one creation per peer; others, and abort(), go on meanwhile
            found = self._by_peer.get(peer)
            if found is None:
                found = create(peer)
                with self._lock:
                    self._by_peer[peer] = found
        return found

    def comms(self) -> list[Communicator]:
        with self._lock:
            return [c for c, _ in self._by_peer.values()] + list(self.creating)

    def async_error(self) -> BaseException | None:
        """The first pair's failure, in the group's ranks."""
        if not self._by_peer:  # (every Work asks: no lock when there are no pairs, as almost always)
            return None
        with self._lock:
            pairs = [(peer, c) for peer, (c, _) in self._by_peer.items()]
        for peer, comm in pairs:
            error = comm.async_error()
            if error is not None:
                lo, hi = sorted((self._rank, peer))
                if "never joined" in str(error):
                    return DistBackendError(f"timeout: rank {peer} never joined the point-to-point communicator "
                                            f"of ranks {lo} and {hi} ({error})")
                return DistBackendError(f"the point-to-point communicator of ranks {lo} and {hi}: {error}")
        return None

    def join(self, stream: Stream) -> None:
        """``stream`` (the group's new one) waits for everything the pairs were given."""
        with self._lock:
            pairs = list(self._by_peer.values())
        for comm, own in pairs:
            comm.join_p2p(own)
            stream.wait_event(own.record())

    def abort(self) -> None:
        for comm in self.comms():
            comm.abort()

    def destroy(self) -> None:
        with self._lock:
            pairs, self._by_peer = list(self._by_peer.values()), {}
        for comm, _ in pairs:
            if comm.state is CommState.INITIALIZING:
                comm.abort()
            comm.destroy()
