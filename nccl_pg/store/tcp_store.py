"""TCPStore client (and, with ``is_master=True``, the server in a thread).

A TCPStore, its clones and every PrefixStore over them share ONE connection
to the server, whatever the number of threads that use them. Requests carry
a tag; the server answers a blocked request (get, wait, multi_get,
queue_pop) when it can, without holding up the requests behind it, so a
thread parked in ``wait()`` never delays another thread's ``set()``, and a
parked wait costs no traffic. No thread reads for others in the background:
the thread that waits for an answer reads the socket ("leader") and hands
other threads the answers it finds; when it has its own, the next waiting
thread takes over. A single-threaded caller thus pays one send and one recv
per request, and a ``set()`` (unanswered, as torch's) one send.

Every call has a deadline: waits are answered by the server at theirs, and
the client gives up on a silent server a little later. A forked child never
touches its parent's socket: it opens its own connection on first use.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Sequence

from .. import env
from ..errors import DistError, DistNetworkError, DistStoreError, QueueEmptyError
from ..timeouts import Timeout, to_seconds
from . import protocol as P
from .base import (
    COUNTED_PREFIX,
    HIDDEN_PREFIX,
    Backoff,
    Parking,
    Store,
    Unparked,
    Value,
    check_amount,
    check_key,
    check_keys,
    check_multi_set,
    fork_count,
    timeout_error,
    to_bytes,
)
from .tcp_server import TCPStoreServer

log = logging.getLogger(__name__)

_WORKERS_KEY = COUNTED_PREFIX + "workers"  # counted by num_keys(), as torch's worker counter
_WORKERS_READY_KEY = HIDDEN_PREFIX + "workers_ready"
# How long past a wait's own deadline the client waits for the server's answer: the server ends the wait at
# its deadline and answers at once, so this only covers the round trip and a busy server's queue.
_ANSWER_GRACE = 5.0
# Backoff between attempts to connect or handshake: a server starting this instant is found within
# milliseconds, and a missing one costs at most one attempt a second until the deadline.
_CONNECT_RETRY_FIRST = 0.01
_CONNECT_RETRY_MAX = 1.0
# Below glibc's mmap threshold, so a small answer costs no mmap/munmap.
_RECV_SIZE = 64 * 1024
_SET_HEAD_PACK = struct.Struct("<IBII").pack  # frame length, op, tag, key length
_REQUEST_HEAD_PACK = P.REQUEST_HEAD.pack
_U32_PACK, _F64_PACK, _I64_PACK, _I64_UNPACK = P.U32.pack, P.F64.pack, P.I64.pack, P.I64.unpack_from
# Plain ints: packing an IntEnum costs a conversion per request.
_OP_SET, _OP_GET, _OP_ADD = int(P.Op.SET), int(P.Op.GET), int(P.Op.ADD)
_ONE = P.I64.pack(1)
_MAX_KEY = P.FRAME_OVERHEAD - 64  # a key must leave room for the frame's other fields
_TIMEVAL = struct.Struct("ll")
_CLOSE_FLUSH = 5.0  # at most this long, close() confirms that the sets it sent were applied

# multi_tenant masters of this process: (host, port) -> [server, users]
_tenants: dict[tuple[str, int], list] = {}
_tenants_lock = threading.Lock()


_live_clients: weakref.WeakSet[_Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_live_clients):
        client.forget_parent()


if hasattr(os, "register_at_fork"):  # rather than a pid check on every call
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Retry(Exception):
    """Nothing was sent, or the server said it handled nothing (GOAWAY): try on a new connection."""


class _Broken(Exception):
    """The connection failed; ``kind`` is lost, closed or fatal, ``detail`` says how."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(kind, detail)
        self.kind, self.detail = kind, detail


class _Slot:
    """A request waiting for its answer (class attributes are the defaults:
    a slot is made per request, so it costs no __init__)."""

    body: bytes | None = None
    failure: BaseException | None = None
    wake: threading.Lock | None = None  # held while its thread sleeps; released to wake it
    signalled = False


class _Connection:
    """One authenticated socket to the server, shared by the store's threads."""

    def __init__(self, client: _Client, deadline: float) -> None:
        self.client = client
        self.buf = bytearray()
        self.send_lock = threading.Lock()
        self.read_lock = threading.Lock()  # held by the leader
        self.state_lock = threading.Lock()  # slots' answers and wake-ups
        self.slots: dict[int, _Slot] = {}
        self.tags = iter(range(1, 1 << 32))  # next() on it is atomic under the GIL
        self.failure: BaseException | None = None  # _Retry or _Broken once unusable
        self.sets_sent = 0
        self.sets_confirmed = 0  # sets sent before a request the server has answered
        self.rcvtimeo = math.inf
        backoff = Backoff(deadline, first=_CONNECT_RETRY_FIRST, cap=_CONNECT_RETRY_MAX)
        while True:
            self.sock = self._connect(deadline)
            try:
                self.max_value_size, idle = self._handshake(deadline)
                break
            except TimeoutError:
                self.sock.close()
                raise DistNetworkError(f"timeout: store server {client.address} did not complete the "
                                       f"handshake") from None
            except OSError as exc:
                # The server drops a handshake that takes too long (a process
                # whose threads starve can be that slow): try again in time.
                self.sock.close()
                self.buf.clear()
                if not backoff.sleep():
                    raise DistNetworkError(f"connection to store server {client.address} lost during the "
                                           f"handshake: {exc}") from None
            except BaseException:
                self.sock.close()
                raise
        # Blocking socket with kernel timeouts: one system call per send and
        # per recv (settimeout() would add a poll to each).
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(client.send_timeout))
        # Reconnect well before the server's idle timeout, so that nothing is
        # sent to a connection it is closing.
        self.idle_limit = idle / 2 if idle > 0 else math.inf
        self.last_use = time.monotonic()

    def _connect(self, deadline: float) -> socket.socket:
        client = self.client
        backoff = Backoff(deadline, first=_CONNECT_RETRY_FIRST, cap=_CONNECT_RETRY_MAX)
        while True:
            try:
                sock = socket.create_connection((client.host, client.port),
                                                timeout=max(deadline - time.monotonic(), 0.01))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as exc:
                # Before the first success the server may simply not be up yet;
                # afterwards a refusal means it is gone, and retrying would hang.
                if client.ever_connected and isinstance(exc, ConnectionRefusedError):
                    raise DistNetworkError(
                        f"store server {client.address} is gone (connection refused); it was reachable before"
                    ) from None
                last = exc
            if not backoff.sleep():
                raise DistNetworkError(
                    f"timeout: could not connect to store server {client.address} within "
                    f"{client.connect_timeout:.1f} s: {last}"
                ) from None

    def _handshake(self, deadline: float) -> tuple[int, float]:
        client = self.client
        sock = self.sock
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        client_nonce = os.urandom(P.NONCE_SIZE)
        sock.sendall(P.MAGIC + client_nonce)
        hello = self._recv_handshake_frame(deadline)
        try:
            server_nonce, flags, max_value_size, idle, server_proof = P.SERVER_HELLO.unpack(hello)
        except struct.error:
            raise DistNetworkError(f"{client.address} did not answer like a TCPStore server of this nccl_pg "
                                   f"version") from None
        secret = client.secret
        if secret:
            if not flags & P.FLAG_AUTH:
                raise DistStoreError(
                    f"store server {client.address} does not use authentication but this client has a secret "
                    f"(NCCL_PG_STORE_SECRET); refusing to trust it"
                )
            if server_proof != P.proof(secret, b"server", client_nonce, server_nonce):
                raise DistStoreError(
                    f"authentication failed: store server {client.address} does not know this client's secret "
                    f"(NCCL_PG_STORE_SECRET differs between client and server)"
                )
            client_proof = P.proof(secret, b"client", server_nonce, client_nonce)
        else:
            client_proof = b""
        sock.sendall(P.frame(client_proof))
        answer = self._recv_handshake_frame(deadline)
        tag, status = P.U32.unpack_from(answer)[0], answer[4]
        if tag != P.CONNECTION_TAG or status != P.Status.OK:
            message = P.Reader(answer, 5).str() if status == P.Status.FATAL else "malformed answer"
            raise DistStoreError(f"store server {client.address} refused the connection: {message}")
        client.ever_connected = True
        return max_value_size, idle

    def _recv_handshake_frame(self, deadline: float) -> bytes:
        while True:
            if len(self.buf) >= 4:
                n = 4 + P.U32.unpack_from(self.buf)[0]
                if len(self.buf) >= n:
                    body = bytes(self.buf[4:n])
                    del self.buf[:n]
                    return body
            self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = self.sock.recv(_RECV_SIZE)
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            self.buf += chunk

    # --- sending ----------------------------------------------------------------

    def send(self, frame: bytes, is_set: bool = False) -> None:
        with self.send_lock:
            if self.failure is not None:  # nothing sent: the caller may use a new connection
                raise _Retry()
            try:
                self.sock.sendall(frame)
                error = None
            except OSError as exc:  # a partial frame may have gone out: the stream is unusable
                error = exc
            else:
                if is_set:
                    self.sets_sent += 1
        if error is not None:
            raise self.client.lost(self, error)

    def request(self, op: int, fields: bytes, deadline: float) -> bytes:
        """Send a request and return its answer's status and fields."""
        tag = next(self.tags)
        slot = _Slot()
        slots = self.slots
        slots[tag] = slot
        sets_before = self.sets_sent
        try:
            self.send(_REQUEST_HEAD_PACK(5 + len(fields), op, tag) + fields)
            if self.read_lock.acquire(False):
                try:
                    body = self._lead(tag, slot, deadline)
                finally:
                    self.read_lock.release()
                    if len(slots) > 1:
                        self._hand_over(slot)
            else:
                body = self._follow(tag, slot, deadline)
        finally:
            del slots[tag]
        if sets_before > self.sets_confirmed:  # the server handles a connection's requests in order
            self.sets_confirmed = sets_before
        return body

    # --- receiving: one leader reads, the others sleep --------------------------

    def _follow(self, tag: int, slot: _Slot, deadline: float) -> bytes:
        """Sleep until the leader hands us our answer, or the reading."""
        with self.state_lock:
            slot.wake = wake = threading.Lock()
            wake.acquire()
        while True:
            if slot.body is not None:
                return slot.body
            if slot.failure is not None:
                raise _fresh(slot.failure)
            # Tried after the wake lock exists: a leader that left before it
            # could see this slot has released the read lock by now.
            if self.read_lock.acquire(False):
                try:
                    return self._lead(tag, slot, deadline)
                finally:
                    self.read_lock.release()
                    self._hand_over(slot)
            left = deadline - time.monotonic()
            if left <= 0 or not wake.acquire(timeout=left):
                if slot.body is not None:
                    return slot.body
                self._hand_over(slot)  # we may have been picked to read just as we gave up
                raise TimeoutError
            with self.state_lock:
                slot.signalled = False

    def _lead(self, tag: int, slot: _Slot, deadline: float) -> bytes:
        while slot.body is None:  # else a previous leader delivered it
            if slot.failure is not None:
                raise _fresh(slot.failure)
            try:
                answer_tag, body = self._read_answer(deadline)
            except OSError as exc:
                raise self.client.lost(self, exc) from None
            if answer_tag == tag:
                return body
            if answer_tag == P.CONNECTION_TAG:
                raise self._connection_message(body)
            self._deliver(answer_tag, body)
        return slot.body

    def _read_answer(self, deadline: float) -> tuple[int, bytes]:
        """The next answer: (tag, status and fields)."""
        buf = self.buf
        while True:
            if len(buf) >= 8:
                n = P.U32.unpack_from(buf)[0] + 4
                if len(buf) >= n:
                    tag = P.U32.unpack_from(buf, 4)[0]
                    body = bytes(buf[8:n])
                    del buf[:n]
                    return tag, body
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            # Re-arm the kernel timeout only when it would overshoot the
            # deadline noticeably (or wake up far too early).
            if self.rcvtimeo > left * 1.05 + 0.01 or self.rcvtimeo < left * 0.5:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(left))
                self.rcvtimeo = left
            try:
                chunk = self.sock.recv(_RECV_SIZE)
            except BlockingIOError:  # SO_RCVTIMEO expired
                continue
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            if not buf and len(chunk) >= 8 and P.U32.unpack_from(chunk)[0] + 4 == len(chunk):
                return P.U32.unpack_from(chunk, 4)[0], chunk[8:]  # the usual case: exactly one answer
            buf += chunk

    def _deliver(self, tag: int, body: bytes) -> None:
        with self.state_lock:
            slot = self.slots.get(tag)
            if slot is None:  # its caller gave up (timeout): a late answer
                return
            slot.body = body
            if slot.wake is not None and not slot.signalled:
                slot.signalled = True
                slot.wake.release()

    def _hand_over(self, own: _Slot) -> None:
        """Wake one other thread still waiting for an answer, to read in our place."""
        with self.state_lock:
            for slot in self.slots.values():
                if (slot is not own and slot.wake is not None and slot.body is None and slot.failure is None
                        and not slot.signalled):
                    slot.signalled = True
                    slot.wake.release()
                    return

    def fail(self, failure: BaseException) -> None:
        """Mark the connection unusable and release every waiting thread with ``failure``."""
        with self.state_lock:
            if self.failure is None:
                self.failure = failure
            for slot in self.slots.values():
                if slot.body is None and slot.failure is None:
                    slot.failure = failure
                    if slot.wake is not None and not slot.signalled:
                        slot.signalled = True
                        slot.wake.release()

    def _connection_message(self, body: bytes) -> BaseException:
        status = body[0] if body else P.Status.ERROR
        message = P.Reader(body, 1).str() if len(body) > 1 else "malformed message"
        failure: BaseException
        if status == P.Status.GOAWAY:
            failure = _Retry()  # nothing after it was handled
        else:
            failure = _Broken("fatal", message)
        self.fail(failure)
        self.client.drop(self)
        return failure

    def unconfirmed_sets(self) -> int:
        return self.sets_sent - self.sets_confirmed

    def shutdown(self) -> None:
        """Close; wakes a thread blocked in recv (close() alone does not)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _fresh(failure: BaseException) -> BaseException:
    """A copy to raise in this thread (one exception object raised in several threads mixes their tracebacks)."""
    if isinstance(failure, _Broken):
        return _Broken(failure.kind, failure.detail)
    return _Retry()


def _timeval(seconds: float) -> bytes:
    micros = max(int(seconds * 1e6), 1000)  # 0 would mean "no timeout"
    return _TIMEVAL.pack(micros // 1_000_000, micros % 1_000_000)


class _Client:
    """The connection of a TCPStore and its clones, made on first use (again
    after a loss, an idle period or a fork)."""

    def __init__(self, host: str, port: int, secret: bytes | None, timeout: float, connect_timeout: float) -> None:
        self.host, self.port, self.secret = host, port, secret
        self.address = f"{host}:{port}"
        self.connect_timeout = connect_timeout
        self.send_timeout = timeout + _ANSWER_GRACE
        self.ever_connected = False
        self.max_value_size = env.STORE_MAX_VALUE_SIZE.default  # the server's, once connected
        self.lock = threading.Lock()
        self.conn: _Connection | None = None
        self.closed = False
        self.users = 1
        _live_clients.add(self)

    def forget_parent(self) -> None:
        """In a forked child (at once, from the fork hook): the parent's socket
        and locks are not ours; the next request opens a connection of our own."""
        self.lock = threading.Lock()
        inherited, self.conn = self.conn, None
        if inherited is not None:
            inherited.sock.close()  # our copy of the descriptor only: never shutdown()

    def connection(self) -> _Connection:
        """The connection, for a request about to be sent on it."""
        conn = self.conn
        now = time.monotonic()
        if conn is not None and conn.failure is None and (now - conn.last_use < conn.idle_limit or conn.slots):
            conn.last_use = now
            return conn
        return self._reconnect()

    def _reconnect(self) -> _Connection:
        with self.lock:
            if self.closed:
                raise DistStoreError(f"TCPStore({self.address}) is closed")
            conn = self.conn
            if conn is not None and conn.failure is None:
                if conn.slots or time.monotonic() - conn.last_use < conn.idle_limit:
                    return conn
                with conn.send_lock:  # idle: retire it before the server's idle timeout does
                    conn.failure = _Retry()
                conn.sock.close()
            conn = _Connection(self, time.monotonic() + self.connect_timeout)
            self.max_value_size = conn.max_value_size
            self.conn = conn
            return conn

    def drop(self, conn: _Connection) -> None:
        with self.lock:
            if self.conn is conn:
                self.conn = None
        conn.sock.close()

    def lost(self, conn: _Connection, exc: BaseException) -> _Broken:
        """The connection broke: fail it and every request on it."""
        if self.closed:
            broken = _Broken("closed", "")
        else:
            unconfirmed = conn.unconfirmed_sets()
            note = (f"; {unconfirmed} set() call(s) sent before it had not been confirmed and may be lost"
                    if unconfirmed else "")
            broken = _Broken("lost", f"{exc}{note}")
        conn.fail(broken)
        self.drop(conn)
        return broken

    def close(self) -> None:
        conn = self.conn
        if conn is not None and conn.failure is None and conn.unconfirmed_sets():
            try:  # confirm that the set() calls still in flight were applied
                conn.request(P.Op.PING, b"", time.monotonic() + _CLOSE_FLUSH)
            except (_Retry, _Broken, TimeoutError, OSError) as exc:
                log.warning("TCPStore(%s).close(): %d set() call(s) were not confirmed by the server and may be "
                            "lost (%s)", self.address, conn.unconfirmed_sets(), type(exc).__name__)
        with self.lock:
            self.closed = True
            conn, self.conn = self.conn, None
        if conn is not None:
            conn.fail(_Broken("closed", ""))
            conn.shutdown()


class _OwnConnection(Parking):
    """TCPStore.parking(): closing the store ends the wait."""

    def __init__(self, store: TCPStore) -> None:
        super().__init__(store)
        self._own = store

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        if self.closed:
            raise Unparked(f"the wait for {list(keys)!r} on {self._own!r} was ended")
        try:
            self._own.wait(keys, timeout)
        except DistError as exc:
            if self.closed:
                raise Unparked(f"the wait for {list(keys)!r} on {self._own!r} was ended") from exc
            raise

    def close(self) -> None:
        # Closing takes the client's lock, which a connection attempt to a frozen server holds until its
        # deadline: never on the caller's thread.
        if not self.closed:
            self.closed = True
            threading.Thread(target=self._own.close, name="nccl_pg-unpark", daemon=True).start()


class TCPStore(Store):
    """A client of a TCPStoreServer; with ``is_master=True`` it also starts
    the server (in a daemon thread of this process) on ``port`` (0: any free
    port; read it back from ``.port``).

    torch's constructor arguments are accepted: ``world_size`` (every client
    registers; with ``wait_for_workers`` the master's constructor waits for
    that many), ``multi_tenant`` (masters of one process on the same address
    share one server), ``master_listen_fd`` (serve on this already bound
    socket), ``use_libuv`` (ignored: our server is neither of torch's).
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = 300.0,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        secret: str | bytes | None = None,
        max_value_size: int | None = None,
        connect_timeout: Timeout | None = None,
    ) -> None:
        super().__init__(timeout)
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise ValueError(f"TCPStore world_size must be a positive int or None, got {world_size!r}")
        if secret is None:
            secret = env.STORE_SECRET.get()
        secret_bytes = secret.encode() if isinstance(secret, str) else secret
        self.connect_timeout = self.timeout if connect_timeout is None else to_seconds(connect_timeout, "connect_timeout")
        self._server: TCPStoreServer | None = None
        self._tenant: tuple[str, int] | None = None
        self._owner_forks = fork_count()
        if is_master:
            self._server = self._start_server(host_name, port, secret_bytes, max_value_size, multi_tenant,
                                              master_listen_fd)
            port = self._server.port
            if world_size is not None:
                self._server.warn_if_short_of_descriptors(world_size)
        elif not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"port must be an int in 1..65535, got {port!r}")
        self.host, self.port = host_name, port
        self.world_size = world_size
        self._client = _Client(host_name, port, secret_bytes, self.timeout, self.connect_timeout)
        self._closed = False
        try:
            self._client.connection()
            if world_size is not None:
                self._register_worker(world_size, is_master and wait_for_workers)
        except BaseException:
            self.close()
            raise

    def _start_server(self, host: str, port: int, secret: bytes | None, max_value_size: int | None,
                      multi_tenant: bool, listen_fd: int | None) -> TCPStoreServer:
        if not (multi_tenant and port):
            return TCPStoreServer(host, port, secret, max_value_size, listen_fd=listen_fd).start()
        with _tenants_lock:
            self._tenant = (host, port)
            entry = _tenants.get(self._tenant)
            if entry is None:
                entry = _tenants[self._tenant] = [TCPStoreServer(host, port, secret, max_value_size,
                                                                 listen_fd=listen_fd).start(), 0]
            entry[1] += 1
            return entry[0]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"TCPStore({self.address})"

    @property
    def server(self) -> TCPStoreServer | None:
        return self._server

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> TCPStore:
        """Another TCPStore object on the same connection (never a server)."""
        other = object.__new__(TCPStore)
        other.__dict__.update(self.__dict__)
        other._server, other._tenant, other._closed = None, None, False
        with self._client.lock:
            self._client.users += 1
        return other

    def parking(self) -> Parking:
        """A wait on a connection of its own (made at first use), which
        ``close()`` ends at once without disturbing the calls of other
        threads on the shared connection."""
        other = object.__new__(TCPStore)
        other.__dict__.update(self.__dict__)
        other._server, other._tenant, other._closed = None, None, False
        c = self._client
        other._client = _Client(c.host, c.port, c.secret, self.timeout, self.connect_timeout)
        return _OwnConnection(other)

    def _register_worker(self, world_size: int, wait: bool) -> None:
        if self.add(_WORKERS_KEY, 1) == world_size:
            self.set(_WORKERS_READY_KEY, b"1")
        if wait:
            try:
                self.wait([_WORKERS_READY_KEY])
            except DistStoreError:
                n = self.add(_WORKERS_KEY, 0)
                raise DistStoreError(  # the second sentence is torch's, which log parsers may look for
                    f"timeout: only {n} of {world_size} workers connected to the store at {self.address}: "
                    f"Timed out after {self.timeout:g} seconds waiting for clients. {n}/{world_size} clients joined."
                ) from None

    # --- requests ---------------------------------------------------------------

    def _call(self, op: int, fields: bytes, what: str, keys: list[str], wait: float | None = None) -> bytes:
        """Send one request; returns its OK answer (status byte and fields).
        ``wait`` is the server-side deadline of a blocking request."""
        if self._closed:
            raise DistStoreError(f"{self!r} is closed")
        client = self._client
        if len(fields) + 5 > client.max_value_size + P.FRAME_OVERHEAD:  # the server would drop the connection
            raise ValueError(f"{what} request of {len(fields) + 5} bytes is over the store's frame limit of "
                             f"{client.max_value_size + P.FRAME_OVERHEAD} bytes (max value size "
                             f"{client.max_value_size} plus 1 MiB for keys)")
        start = time.monotonic()
        deadline = start + (self._timeout if wait is None else wait) + _ANSWER_GRACE
        for _ in range(3):
            conn = client.connection()
            try:
                body = conn.request(op, fields, deadline)
            except _Retry:  # retired, or told to go away before it handled this: safe to send again
                continue
            except _Broken as exc:
                raise self._broken(exc, what, keys) from None
            except TimeoutError:
                raise DistStoreError(
                    f"timeout: no answer from store server {self.address} to {what}({keys!r}) within "
                    f"{deadline - start:.1f} s"
                ) from None
            if body[0] == P.Status.OK:
                return body
            raise self._refused(body, what, keys, time.monotonic() - start)
        raise DistNetworkError(f"store server {self.address} kept closing the connection during {what}({keys!r})")

    def _broken(self, exc: _Broken, what: str, keys: list[str]) -> DistError:
        if exc.kind == "closed":
            return DistStoreError(f"{self!r} was closed during {what}({keys!r})")
        if exc.kind == "fatal":
            return DistStoreError(f"store server {self.address} refused {what}({keys!r}) and closed the "
                                  f"connection: {exc.detail}")
        return DistNetworkError(f"connection to store server {self.address} lost during {what}({keys!r}): "
                                f"{exc.detail}; the server process may have exited")

    def _refused(self, body: bytes, what: str, keys: list[str], waited: float) -> DistStoreError:
        status, r = body[0], P.Reader(body, 1)
        if status == P.Status.TIMEOUT:
            return timeout_error(f"{self!r}.{what}", keys, r.str_list(), waited)
        if status == P.Status.EMPTY:
            return QueueEmptyError(f"queue_pop({keys[0]!r}) on {self!r}: queue is empty")
        message = r.str() if status == P.Status.ERROR else f"malformed answer (status {status})"
        return DistStoreError(f"store server {self.address} refused {what}: {message}")

    def _check_value(self, key: str, value: bytes) -> bytes:
        limit = self._client.max_value_size
        if len(value) > limit:
            raise ValueError(f"value for key {key!r} is {len(value)} bytes, over the store's limit of {limit} bytes")
        return value

    # --- operations ---------------------------------------------------------

    def set(self, key: str, value: Value) -> None:
        """Returns once the request is sent (as torch's): the server applies a
        process's requests in order, so any later call of this process sees
        it, and a failure surfaces at the next call (and at ``close()``)."""
        if type(key) is not str or not key.isascii():
            key = check_key(key)
        if type(value) is not bytes:
            value = to_bytes(value, key)
        client = self._client
        k = key.encode()
        n = len(value)
        if n > client.max_value_size or len(k) > _MAX_KEY:
            self._check_value(key, value)
            raise ValueError(f"set request for a key of {len(k)} bytes is over the store's frame limit")
        frame = b"".join((_SET_HEAD_PACK(13 + len(k) + n, _OP_SET, 0, len(k)), k, _U32_PACK(n), value))
        # The common case inline (this is the rendezvous' most frequent call):
        # the connection is up, not idle, not inherited through a fork.
        conn = client.conn
        now = time.monotonic()
        if (conn is not None and not self._closed and conn.failure is None
                and now - conn.last_use < conn.idle_limit):
            conn.last_use = now
            error = None
            with conn.send_lock:
                if conn.failure is None:
                    try:
                        conn.sock.sendall(frame)
                    except OSError as exc:  # a partial frame may have gone out: the stream is unusable
                        error = exc
                    else:
                        conn.sets_sent += 1
                        return
            if error is not None:  # (outside the send lock: lost() takes the client's)
                raise self._broken(client.lost(conn, error), "set", [key])
        self._send_set(key, frame)

    def _send_set(self, key: str, frame: bytes) -> None:
        if self._closed:
            raise DistStoreError(f"{self!r} is closed")
        for _ in range(3):
            try:
                self._client.connection().send(frame, True)
                return
            except _Retry:
                continue
            except _Broken as exc:
                raise self._broken(exc, "set", [key]) from None
        raise DistNetworkError(f"store server {self.address} kept closing the connection during set({key!r})")

    def get(self, key: str) -> bytes:
        key = check_key(key)
        k = key.encode()
        body = self._call(_OP_GET, b"".join((_U32_PACK(len(k)), k, _F64_PACK(self._timeout))), "get", [key],
                          self._timeout)
        return body[5:]  # status, u32 length, value

    def add(self, key: str, amount: int) -> int:
        if type(amount) is not int or not -(2**63) <= amount < 2**63:
            amount = check_amount(amount)
        key = check_key(key)
        k = key.encode()
        return _I64_UNPACK(self._call(_OP_ADD, b"".join((_U32_PACK(len(k)), k, _I64_PACK(amount))), "add",
                                      [key]), 1)[0]

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = check_key(key)
        expected = to_bytes(expected, key)
        desired = self._check_value(key, to_bytes(desired, key))
        fields = P.pack_bytes(key.encode()) + P.pack_bytes(expected) + P.pack_bytes(desired)
        return self._call(P.Op.COMPARE_SET, fields, "compare_set", [key])[5:]

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        keys = check_keys(keys)
        seconds = self._deadline(timeout)
        fields = P.pack_list([k.encode() for k in keys]) + P.F64.pack(seconds)
        self._call(P.Op.WAIT, fields, "wait", keys, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        return self._call(P.Op.CHECK, P.pack_list([k.encode() for k in keys]), "check", keys)[1:] == _ONE

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        return self._call(P.Op.DELETE, P.pack_bytes(key.encode()), "delete_key", [key])[1:] == _ONE

    def num_keys(self) -> int:
        return _I64_UNPACK(self._call(P.Op.NUM_KEYS, b"", "num_keys", []), 1)[0]

    def list_keys(self) -> list[str]:
        return P.Reader(self._call(P.Op.LIST_KEYS, b"", "list_keys", []), 1).str_list()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        fields = P.pack_list([k.encode() for k in keys]) + P.F64.pack(self._timeout)
        return P.Reader(self._call(P.Op.MULTI_GET, fields, "multi_get", keys, self._timeout), 1).list()

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        keys, data = check_multi_set(keys, values)
        for key, value in zip(keys, data, strict=True):
            self._check_value(key, value)
        fields = P.pack_list([k.encode() for k in keys]) + P.pack_list(data)
        self._call(P.Op.MULTI_SET, fields, "multi_set", keys)

    def append(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = self._check_value(key, to_bytes(value, key))
        self._call(P.Op.APPEND, P.pack_bytes(key.encode()) + P.pack_bytes(value), "append", [key])

    def queue_push(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = self._check_value(key, to_bytes(value, key))
        self._call(P.Op.QUEUE_PUSH, P.pack_bytes(key.encode()) + P.pack_bytes(value), "queue_push", [key])

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key = check_key(key)
        wait = self._timeout if block else 0.0
        fields = P.pack_bytes(key.encode()) + P.F64.pack(wait)
        return self._call(P.Op.QUEUE_POP, fields, "queue_pop", [key], wait)[5:]

    def queue_len(self, key: str) -> int:
        key = check_key(key)
        return _I64_UNPACK(self._call(P.Op.QUEUE_LEN, P.pack_bytes(key.encode()), "queue_len", [key]), 1)[0]

    def local_address(self) -> str:
        """This host's address on the connection to the server: the interface
        that reaches the other hosts."""
        return self._client.connection().sock.getsockname()[0]

    def ping(self) -> float:
        """Round-trip time to the server in seconds."""
        start = time.perf_counter()
        self._call(P.Op.PING, b"", "ping", [])
        return time.perf_counter() - start

    def close(self) -> None:
        """Release this object's share of the connection (the last user of
        it confirms its pending sets and closes it) and stop the server it
        started (only in the process that started it)."""
        if self._closed:
            return
        self._closed = True
        client = self._client
        with client.lock:
            client.users -= 1
            last = client.users == 0
        if last:
            client.close()
        if self._server is not None and self._owner_forks == fork_count():
            self._stop_server()

    def _stop_server(self) -> None:
        server, self._server = self._server, None
        if self._tenant is not None:
            with _tenants_lock:
                entry = _tenants[self._tenant]
                entry[1] -= 1
                if entry[1]:
                    return
                del _tenants[self._tenant]
        server.stop()  # type: ignore[union-attr]

