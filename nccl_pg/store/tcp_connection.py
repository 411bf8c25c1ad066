"""The client side of a TCPStore connection: one authenticated socket to the
server, shared by every thread of a TCPStore, its clones and the
PrefixStores over them.

Requests carry a tag; the server answers a blocked request (get, wait,
multi_get, queue_pop) when it can, without holding up the requests behind
it. No thread reads for others in the background: the thread that waits for
an answer reads the socket ("leader") and hands other threads the answers it
finds; when it has its own, or its deadline passes, the next waiting thread
takes over. A single-threaded caller thus pays one send and one recv per
request, and a ``set()`` (unanswered, as torch's) one send.

Every call keeps its own deadline, whatever the other threads do on the
connection:

- reading: a call whose deadline passes gives up its place (and hands the
  reading to another waiting thread); the connection and the other calls
  go on. Only an error of the socket itself (EOF, reset) fails them all.
- sending: frames never interleave, so one thread sends at a time (the send
  lock), and a thread waits for that lock only until its own deadline. A
  frame is sent without blocking, waiting for room in the socket buffer at
  most until its sender's deadline. The rule for a frame cut by its
  deadline: once its first byte is on the stream, the rest goes before any
  byte of another frame. The caller is told that its request timed out and
  may still be applied; the rest waits in ``Connection.rest`` and whichever
  thread sends next sends it first (within that thread's own deadline). So
  the server always reads whole frames, and no call ever waits on another's
  deadline.

A forked child never touches its parent's socket: it opens its own
connection on first use.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import struct
import threading
import time
import weakref

from .. import env
from ..errors import DistNetworkError, DistStoreError
from . import protocol as P
from .base import Backoff, SharedClient

log = logging.getLogger(__name__)

# Backoff between attempts to connect or handshake: a server starting this instant is found within
# milliseconds, and a missing one costs at most one attempt a second until the deadline.
_CONNECT_RETRY_FIRST = 0.01
_CONNECT_RETRY_MAX = 1.0
# Below glibc's mmap threshold, so a small answer costs no mmap/munmap.
_RECV_SIZE = 64 * 1024
_REQUEST_HEAD_PACK = P.REQUEST_HEAD.pack
_TIMEVAL = struct.Struct("ll")
_CLOSE_FLUSH = 5.0  # at most this long, close() confirms that the sets it sent were applied

_live_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_live_clients):
        client.forget_parent()


if hasattr(os, "register_at_fork"):  # rather than a pid check on every call
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Retry(Exception):
    """Nothing was sent, or the server said it handled nothing (GOAWAY): try on a new connection."""


class Broken(Exception):
    """The connection failed; ``kind`` is lost, closed or fatal, ``detail`` says how."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(kind, detail)
        self.kind, self.detail = kind, detail


class CallTimeout(Exception):
    """This call's deadline passed; the connection and the other calls on it
    are fine. ``stage``: "send" (nothing of its request went out), "partial"
    (part of it did: the rest goes out ahead of the next request, so the
    server may still apply it) or "answer" (sent, not answered in time)."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


class _Slot:
    """A request waiting for its answer (class attributes are the defaults:
    a slot is made per request, so it costs no __init__)."""

    body: bytes | None = None
    failure: BaseException | None = None
    wake: threading.Lock | None = None  # held while its thread sleeps; released to wake it
    signalled = False


class Connection:
    """One authenticated socket to the server, shared by the store's threads."""

    def __init__(self, client: Client, deadline: float) -> None:
        self.client = client
        self.buf = bytearray()
        self.send_lock = threading.Lock()
        self.read_lock = threading.Lock()  # held by the leader
        self.state_lock = threading.Lock()  # slots' answers and wake-ups
        self.slots: dict[int, _Slot] = {}
        self.tags = iter(range(1, 1 << 32))  # next() on it is atomic under the GIL
        self.failure: BaseException | None = None  # Retry or Broken once unusable
        self.rest: memoryview | None = None  # the unsent end of a frame whose sender's deadline passed
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
        # Blocking socket with a kernel timeout for receiving, and sends that never block
        # (MSG_DONTWAIT): one system call per send and per recv (settimeout() would add a poll to each).
        self.sock.settimeout(None)
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

    def send(self, frame: bytes, deadline: float, is_set: bool = False) -> None:
        """Send one whole frame, by ``deadline`` (see the module's rule for a
        frame cut by its deadline). Raises CallTimeout, Retry (nothing sent:
        the caller may use a new connection) or Broken."""
        lock = self.send_lock
        if not lock.acquire(False):
            left = deadline - time.monotonic()
            if left <= 0 or not lock.acquire(timeout=left):
                raise CallTimeout("send")
        error: OSError | None = None
        try:
            if self.failure is not None:
                raise Retry()
            if self.rest is not None:  # another frame's end goes first
                self.rest = self._push(self.rest, deadline)
                if self.rest is not None:
                    raise CallTimeout("send")
            try:
                n = self.sock.send(frame, socket.MSG_DONTWAIT)  # usually all of it, in one call
            except BlockingIOError:
                n = 0
            if n < len(frame):
                rest = self._push(memoryview(frame)[n:], deadline)
                if rest is not None:
                    if rest.nbytes == len(frame):
                        raise CallTimeout("send")
                    self.rest = rest
                    if is_set:
                        self.sets_sent += 1
                    raise CallTimeout("partial")
            if is_set:
                self.sets_sent += 1
        except OSError as exc:  # a partial frame may have gone out: the stream is unusable
            error = exc
        finally:
            lock.release()
        if error is not None:  # (outside the send lock: lost() takes the client's)
            raise self.client.lost(self, error)

    def _push(self, data: memoryview, deadline: float) -> memoryview | None:
        """Send ``data``, waiting for room in the socket buffer until
        ``deadline``; returns what is left unsent then (None: all sent)."""
        poller = None
        while data.nbytes:
            try:
                data = data[self.sock.send(data, socket.MSG_DONTWAIT):]
                continue
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return data
            if poller is None:
                poller = select.poll()
                poller.register(self.sock, select.POLLOUT)
            poller.poll(max(math.ceil(left * 1000), 1))
        return None

    def request(self, op: int, fields: bytes, deadline: float) -> bytes:
        """Send a request and return its answer's status and fields."""
        tag = next(self.tags)
        slot = _Slot()
        slots = self.slots
        slots[tag] = slot
        sets_before = self.sets_sent
        try:
            self.send(_REQUEST_HEAD_PACK(5 + len(fields), op, tag) + fields, deadline)
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
                raise fresh(slot.failure)
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
                raise CallTimeout("answer")
            with self.state_lock:
                slot.signalled = False

    def _lead(self, tag: int, slot: _Slot, deadline: float) -> bytes:
        while slot.body is None:  # else a previous leader delivered it
            if slot.failure is not None:
                raise fresh(slot.failure)
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
            if left <= 0:  # this call's deadline, not the connection's end: the next leader reads on
                raise CallTimeout("answer")
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
            failure = Retry()  # nothing after it was handled
        else:
            failure = Broken("fatal", message)
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


def fresh(failure: BaseException) -> BaseException:
    """A copy to raise in this thread (one exception object raised in several threads mixes their tracebacks)."""
    if isinstance(failure, Broken):
        return Broken(failure.kind, failure.detail)
    return Retry()


def _timeval(seconds: float) -> bytes:
    micros = max(int(seconds * 1e6), 1000)  # 0 would mean "no timeout"
    return _TIMEVAL.pack(micros // 1_000_000, micros % 1_000_000)


class Client(SharedClient):
    """The connection of a TCPStore and its clones, made on first use (again
    after a loss, an idle period or a fork)."""

    def __init__(self, host: str, port: int, secret: bytes | None, connect_timeout: float) -> None:
        self.host, self.port, self.secret = host, port, secret
        self.address = f"{host}:{port}"
        self.connect_timeout = connect_timeout
        self.ever_connected = False
        self.max_value_size = env.STORE_MAX_VALUE_SIZE.default  # the server's, once connected
        self.lock = threading.Lock()
        self.conn: Connection | None = None
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

    def connection(self) -> Connection:
        """The connection, for a request about to be sent on it."""
        conn = self.conn
        now = time.monotonic()
        if conn is not None and conn.failure is None and (now - conn.last_use < conn.idle_limit or conn.slots):
            conn.last_use = now
            return conn
        return self._reconnect()

    def _reconnect(self) -> Connection:
        with self.lock:
            if self.closed:
                raise DistStoreError(f"TCPStore({self.address}) is closed")
            conn = self.conn
            if conn is not None and conn.failure is None:
                if conn.slots or time.monotonic() - conn.last_use < conn.idle_limit:
                    return conn
                if not conn.send_lock.acquire(False):
                    return conn  # a thread is sending on it: not idle
                try:  # idle: retire it before the server's idle timeout does
                    conn.failure = Retry()
                finally:
                    conn.send_lock.release()
                conn.sock.close()
            conn = Connection(self, time.monotonic() + self.connect_timeout)
            self.max_value_size = conn.max_value_size
            self.conn = conn
            return conn

    def drop(self, conn: Connection) -> None:
        with self.lock:
            if self.conn is conn:
                self.conn = None
        conn.sock.close()

    def lost(self, conn: Connection, exc: BaseException) -> Broken:
        """The connection broke: fail it and every request on it."""
        if self.closed:
            broken = Broken("closed", "")
        else:
            unconfirmed = conn.unconfirmed_sets()
            note = (f"; {unconfirmed} set() call(s) sent before it had not been confirmed and may be lost"
                    if unconfirmed else "")
            broken = Broken("lost", f"{exc}{note}")
        conn.fail(broken)
        self.drop(conn)
        return broken

    def close(self) -> None:
        conn = self.conn
        if conn is not None and conn.failure is None and conn.unconfirmed_sets():
            try:  # confirm that the set() calls still in flight were applied
                conn.request(P.Op.PING, b"", time.monotonic() + _CLOSE_FLUSH)
            except (Retry, Broken, CallTimeout, OSError) as exc:
                log.warning("TCPStore(%s).close(): %d set() call(s) were not confirmed by the server and may be "
                            "lost (%s)", self.address, conn.unconfirmed_sets(), type(exc).__name__)
        with self.lock:
            self.closed = True
            conn, self.conn = self.conn, None
        if conn is not None:
            conn.fail(Broken("closed", ""))
            conn.shutdown()


