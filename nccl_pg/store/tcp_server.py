"""TCPStore server: one thread, non-blocking sockets, an epoll (or poll) loop.

Blocking requests (get, wait, multi_get, queue_pop) never block the loop, nor
the requests behind them on the same connection: they become waiters,
answered (with their tag) when their keys are set or their deadline passes.
One recv() serves every request it brought in, and a connection's answers
leave in one send() per loop turn; SET, the bulk of rendezvous traffic, is
not answered at all when it succeeds.

What a peer can make the server hold is bounded:
- before authentication nothing beyond the handshake is read (24 bytes, then
  a frame of at most 32), and a peer that does not finish it in
  ``handshake_timeout`` is dropped;
- after it, a connection's input buffer holds at most one frame (a value of
  ``max_value_size`` plus 1 MiB); its answers waiting to be read are capped
  (``OUT_LIMIT``, plus the answer in hand): past it the server stops reading
  the connection's requests until the client reads its answers;
- a connection may have at most ``MAX_WAITERS`` blocked requests, and its
  waiters and buffers are released when it closes;
- a connection that sent nothing for ``idle_timeout`` seconds and has no
  blocked request is told to go away (clients reconnect when they need to);
- out of file descriptors, the server stops accepting for a moment instead of
  spinning, and logs that once per minute with the limit to raise.
"""

from __future__ import annotations

import errno
import heapq
import hmac
import itertools
import logging
import math
import os
import resource
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .. import env
from ..errors import DistNetworkError, DistStoreError
from ..timeouts import to_seconds
from . import protocol as P
from .base import KeyValueState

log = logging.getLogger(__name__)

_RECV_SIZE = 256 * 1024
OUT_LIMIT = 4 << 20  # bytes of unread answers before a connection's input is paused
MAX_WAITERS = 4096  # blocked requests per connection
_SWEEP_PERIOD = 1.0  # seconds between checks of handshake and idle deadlines
_FD_LOG_PERIOD = 60.0  # seconds between warnings while out of descriptors: one a minute, not one per refusal
# Seconds a new connection has to prove the secret: a real client does it in one round trip, so 30 s only
# outlasts a loaded machine and keeps silent port scanners from holding descriptors.
HANDSHAKE_TIMEOUT = 30.0
_STOP_TIMEOUT = 5.0  # seconds stop() waits for the server thread to close everything: it only closes sockets
# Pause before accepting again when out of descriptors: short enough to serve a freed one soon, doubled per
# refusal up to a cap so that a lasting shortage costs one wake-up a second.
_ACCEPT_BACKOFF_FIRST = 0.05
_ACCEPT_BACKOFF_MAX = 1.0
_FD_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_IN = select.POLLIN
_OUT = select.POLLOUT
_HELLO, _AUTH, _READY, _CLOSING = range(4)
_PROOF_FRAME = 4 + P.PROOF_SIZE
_SET = int(P.Op.SET)
_ADD = int(P.Op.ADD)
_GET = int(P.Op.GET)
_QUEUE_POP = int(P.Op.QUEUE_POP)
_WAIT = int(P.Op.WAIT)


class _Waiter:
    __slots__ = ("conn", "tag", "op", "keys", "deadline", "pending", "done")

    def __init__(self, conn: _Conn, tag: int, op: int, keys: list[str], deadline: float) -> None:
        self.conn, self.tag, self.op, self.keys, self.deadline = conn, tag, op, keys, deadline
        self.pending = 0  # keys it is registered under and still waits for
        self.done = False


class _Conn:
    __slots__ = ("sock", "fd", "peer", "phase", "deadline", "inbuf", "out", "client_nonce", "server_nonce",
                 "waiters", "last_active", "events", "paused", "closed")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.phase = _HELLO
        self.deadline = deadline  # of the handshake
        self.inbuf = bytearray()
        self.out = bytearray()
        self.client_nonce = b""
        self.server_nonce = b""
        self.waiters: set[_Waiter] = set()
        self.last_active = deadline
        self.events = _IN
        self.paused = False  # back-pressure: its requests wait until its answers are read
        self.closed = False


class _Poller:
    """epoll where there is one, else poll(); ``poll`` takes seconds."""

    def __init__(self) -> None:
        impl: Any
        if hasattr(select, "epoll"):
            impl = select.epoll()
            self.poll: Callable[[float], list[tuple[int, int]]] = impl.poll  # bound: no wrapper call per turn
            self.close: Callable[[], None] = impl.close
        else:
            impl = select.poll()
            self.poll = lambda seconds: impl.poll(math.ceil(seconds * 1000))
            self.close = lambda: None
        self.register: Callable[[int, int], None] = impl.register
        self.modify: Callable[[int, int], None] = impl.modify
        self.unregister: Callable[[int], None] = impl.unregister


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (each client
    connection costs the server one descriptor); returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # e.g. macOS caps it below an infinite hard limit
            log.debug("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, target, exc)
    return soft, hard


def _listen(host: str, port: int, backlog: int, listen_fd: int | None) -> socket.socket:
    if listen_fd is not None:  # a socket bound by someone else (torch's master_listen_fd)
        try:
            sock = socket.socket(fileno=listen_fd)
        except OSError as exc:
            raise DistNetworkError(f"TCPStoreServer: listen fd {listen_fd} is not a usable socket: {exc}") from None
        if sock.type != socket.SOCK_STREAM:
            sock.detach()
            raise DistNetworkError(f"TCPStoreServer: listen fd {listen_fd} is not a TCP socket")
        sock.listen(backlog)
        sock.setblocking(False)
        return sock
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise DistNetworkError(f"TCPStoreServer: cannot resolve host {host!r}: {exc}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise DistNetworkError(f"TCPStoreServer: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


class TCPStoreServer:
    """The store's server. Runs in a background thread (``start()``), e.g.
    inside rank 0 or the launcher, or in the foreground (``serve_forever()``).

    ``idle_timeout`` (default ``NCCL_PG_STORE_IDLE_TIMEOUT``, 600 s; 0: never)
    applies to authenticated connections with no blocked request. Starting a
    server raises this process's soft file-descriptor limit to the hard one.
    """

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 0,
        secret: str | bytes | None = None,
        max_value_size: int | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        backlog: int = 4096,
        idle_timeout: float | None = None,
        listen_fd: int | None = None,
    ) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if secret is None:
            secret = env.STORE_SECRET.get()
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self.max_value_size = env.STORE_MAX_VALUE_SIZE.get() if max_value_size is None else max_value_size
        if not isinstance(self.max_value_size, int) or self.max_value_size < 1:
            raise ValueError(f"max_value_size must be a positive int, got {self.max_value_size!r}")
        self.idle_timeout = env.STORE_IDLE_TIMEOUT.get() if idle_timeout is None else \
            to_seconds(idle_timeout, "idle_timeout", zero=True)
        self._max_frame = self.max_value_size + P.FRAME_OVERHEAD
        self._handshake_timeout = to_seconds(handshake_timeout, "handshake_timeout")
        self.fd_limit = raise_fd_limit()
        self._listener = _listen(host, port, backlog, listen_fd)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._state = KeyValueState()
        self._waiting: dict[str, dict[_Waiter, None]] = {}  # key -> waiters, oldest first
        self._live_waiters = 0
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._dead_in_heap = 0  # answered waiters still in _deadlines
        self._seq = itertools.count()
        self._conns: dict[int, _Conn] = {}
        self._dirty: dict[_Conn, None] = {}  # connections with answers to send this turn
        self._counts = [0] * 256
        self._now = time.monotonic()
        self._poller = _Poller()
        # One receive buffer for every connection (the loop is single-threaded):
        # recv(n) would allocate, and for n this large mmap/munmap, per read.
        self._rbuf = bytearray(_RECV_SIZE)
        self._rview = memoryview(self._rbuf)
        self._handlers: dict[int, Callable[[_Conn, int, P.Reader], bytes | None]] = {
            P.Op.GET: self._get, P.Op.ADD: self._add, P.Op.COMPARE_SET: self._compare_set,
            P.Op.WAIT: self._wait, P.Op.CHECK: self._check, P.Op.DELETE: self._delete,
            P.Op.NUM_KEYS: self._num_keys, P.Op.MULTI_GET: self._multi_get, P.Op.MULTI_SET: self._multi_set,
            P.Op.APPEND: self._append, P.Op.PING: self._ping, P.Op.QUEUE_PUSH: self._queue_push,
            P.Op.QUEUE_POP: self._queue_pop, P.Op.QUEUE_LEN: self._queue_len, P.Op.LIST_KEYS: self._list_keys,
        }
        self._accept_paused_until = 0.0
        self._accept_backoff = _ACCEPT_BACKOFF_FIRST
        self._fd_refusals = 0
        self._fd_logged_at = -math.inf
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._serving = False
        self._thread: threading.Thread | None = None
        self._finished = threading.Event()

    def __repr__(self) -> str:
        return f"TCPStoreServer({self.host}:{self.port})"

    @property
    def num_connections(self) -> int:
        return len(self._conns)

    @property
    def num_waiters(self) -> int:
        """Blocked get/wait/multi_get/queue_pop requests not yet answered."""
        return self._live_waiters

    def stats(self) -> dict[str, int]:
        """Requests handled since the start, by operation name."""
        return {op.name.lower(): self._counts[op] for op in P.Op}

    def warn_if_short_of_descriptors(self, clients: int) -> None:
        """Log a warning when ``clients`` connections would not fit under the fd limit."""
        soft, hard = self.fd_limit
        if soft != resource.RLIM_INFINITY and clients + 64 > soft:
            log.warning("%r will serve up to %d clients but this process may open only %d files (RLIMIT_NOFILE "
                        "soft %d, hard %d, already raised to the hard limit): the clients beyond it wait in the "
                        "listen backlog until others leave. Raise the hard limit (ulimit -Hn, limits.conf).",
                        self, clients, soft, soft, hard)

    def start(self) -> TCPStoreServer:
        self._serving = True
        self._thread = threading.Thread(target=self.serve_forever, name="nccl_pg-store-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = _STOP_TIMEOUT) -> None:
        """Close every connection and the listening socket; bounded by ``timeout``."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%r: server thread did not stop within %.1f s", self, timeout)
        elif self._thread is None and not self._serving:  # never started: nothing else will close it
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            self._poller.close()
        elif self._thread is None:
            self._finished.wait(timeout)

    def __enter__(self) -> TCPStoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the loop -----------------------------------------------------------

    def serve_forever(self) -> None:
        self._serving = True
        poller, conns, poll, monotonic = self._poller, self._conns, self._poller.poll, time.monotonic
        listen_fd, wake_fd = self._listener.fileno(), self._wake_r.fileno()
        poller.register(listen_fd, _IN)
        poller.register(wake_fd, _IN)
        next_sweep = monotonic() + _SWEEP_PERIOD
        try:
            while not self._stopping:
                wake_at = next_sweep
                if self._deadlines and self._deadlines[0][0] < wake_at:
                    wake_at = self._deadlines[0][0]
                if self._accept_paused_until and self._accept_paused_until < wake_at:
                    wake_at = self._accept_paused_until
                events = poll(max(wake_at - monotonic(), 0.0))
                self._now = now = monotonic()
                for fd, mask in events:
                    conn = conns.get(fd)
                    if conn is None:
                        if fd == listen_fd:
                            self._accept()
                        elif fd == wake_fd:
                            self._wake_r.recv(4096)
                        continue
                    if mask & _OUT:
                        self._flush(conn)
                    if mask & ~_OUT and not conn.closed:
                        self._on_readable(conn)
                if self._deadlines and self._deadlines[0][0] <= now:
                    self._expire_waiters(now)
                if self._accept_paused_until and now >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    poller.register(listen_fd, _IN)
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP_PERIOD
                while self._dirty:  # one send per connection for all the answers of this turn
                    dirty, self._dirty = self._dirty, {}
                    for conn in dirty:
                        self._flush(conn)
        finally:
            for conn in list(conns.values()):
                self._close(conn)
            self._poller.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            self._finished.set()

    def _accept(self) -> None:
        for _ in range(1024):  # then let the other connections have a turn
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _FD_ERRORS:
                    self._pause_accepting(exc)
                    return
                log.debug("%r: accept failed: %s", self, exc)  # e.g. the peer gave up already
                continue
            self._accept_backoff = _ACCEPT_BACKOFF_FIRST
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", self._now + self._handshake_timeout)
            self._conns[conn.fd] = conn
            self._poller.register(conn.fd, _IN)

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of descriptors: the listener stays readable, so accepting again
        at once would spin. Pending clients wait in the backlog meanwhile."""
        self._poller.unregister(self._listener.fileno())
        self._accept_paused_until = self._now + self._accept_backoff
        self._accept_backoff = min(self._accept_backoff * 2, _ACCEPT_BACKOFF_MAX)
        self._fd_refusals += 1
        if self._now - self._fd_logged_at >= _FD_LOG_PERIOD:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warning("%r: cannot accept connections: %s, with %d connections open (RLIMIT_NOFILE soft %d, "
                        "hard %d; %d refusals since the last message). New clients wait in the listen backlog; "
                        "raise the limit (ulimit -n / -Hn) to serve more.",
                        self, exc.strerror or exc, len(self._conns), soft, hard, self._fd_refusals)
            self._fd_logged_at = self._now
            self._fd_refusals = 0

    def _on_readable(self, conn: _Conn) -> None:
        if conn.phase != _READY:
            self._read_handshake(conn)
            return
        if conn.paused:  # (an error or hang-up event) a write error will tell
            return
        try:
            n = conn.sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:
            self._close(conn)
            return
        conn.last_active = self._now
        inbuf = conn.inbuf
        if inbuf:
            inbuf += self._rview[:n]
            self._process_inbuf(conn)
        else:
            pos = self._process(conn, self._rbuf, self._rview, 0, n)
            if pos < n and conn.phase == _READY:
                inbuf += self._rview[pos:n]
        if conn.out:
            self._flush(conn)

    def _process_inbuf(self, conn: _Conn) -> None:
        inbuf = conn.inbuf
        view = memoryview(inbuf)
        try:
            pos = self._process(conn, inbuf, view, 0, len(inbuf))
        finally:
            view.release()
        del inbuf[:pos]

    def _process(self, conn: _Conn, buf: bytearray, view: memoryview, pos: int, end: int) -> int:
        """Handle the whole requests in ``buf[pos:end]``; returns where the
        unhandled rest starts (a partial frame, or input paused by back-pressure)."""
        unpack_u32, unpack_i64, unpack_f64 = P.U32.unpack_from, P.I64.unpack_from, P.F64.unpack_from
        pack_answer, pack_i64, pack_u32 = P.ANSWER_HEAD.pack, P.I64.pack, P.U32.pack
        data, waiting, counts, max_value = self._state.data, self._waiting, self._counts, self.max_value_size
        max_frame, out = self._max_frame, conn.out
        while end - pos >= 4:
            (n,) = unpack_u32(buf, pos)
            if n > max_frame:
                self._fail(conn, f"frame of {n} bytes exceeds the limit of {self._max_frame} bytes "
                                 f"(max value size {self.max_value_size}, NCCL_PG_STORE_MAX_VALUE_SIZE)")
                return end
            if n < 5:
                self._fail(conn, f"malformed request: a frame of {n} bytes has no room for an op and a tag")
                return end
            stop = pos + 4 + n
            if stop > end:
                break
            op = buf[pos + 4]
            counts[op] += 1
            if op == _SET:  # the hot path, inline (its tag is not needed: it is not answered)
                kend = pos + 13 + (unpack_u32(buf, pos + 9)[0] if n >= 9 else stop)
                if kend + 4 > stop or kend + 4 + unpack_u32(buf, kend)[0] != stop:
                    self._fail(conn, "malformed request: bad SET fields")
                    return end
                if stop - kend - 4 > max_value:
                    self._fail(conn, f"value for a SET is {stop - kend - 4} bytes, over the store's limit of "
                                     f"{max_value} bytes (NCCL_PG_STORE_MAX_VALUE_SIZE)")
                    return end
                try:
                    key = str(view[pos + 13:kend], "utf-8")
                except UnicodeDecodeError:
                    self._fail(conn, "malformed request: key is not UTF-8")
                    return end
                data[key] = bytes(view[kend + 4:stop])
                if key in waiting:
                    self._notify(key)
                pos = stop
                continue
            (tag,) = unpack_u32(buf, pos + 5)
            if op == _ADD and n >= 17 and unpack_u32(buf, pos + 9)[0] == n - 17:  # hot too: inline
                try:
                    key = str(view[pos + 13:stop - 8], "utf-8")
                    value = int(data.get(key, 0)) + unpack_i64(buf, stop - 8)[0]
                except (UnicodeDecodeError, ValueError):  # the generic path words the error
                    self._request(conn, op, tag, bytes(view[pos + 9:stop]))
                else:
                    if not -(2**63) <= value < 2**63:
                        self._request(conn, op, tag, bytes(view[pos + 9:stop]))
                    else:
                        data[key] = b"%d" % value
                        out += pack_answer(13, tag, 0)
                        out += pack_i64(value)
                        if key in waiting:
                            self._notify(key)
            elif (op == _GET and n >= 17 and unpack_u32(buf, pos + 9)[0] == n - 17
                  and 0 < unpack_f64(buf, stop - 8)[0] < math.inf):  # hot too: inline when the key is there
                try:
                    value = data.get(str(view[pos + 13:stop - 8], "utf-8"))
                except UnicodeDecodeError:
                    value = None
                if value is None:  # park a waiter, or word the error
                    self._request(conn, op, tag, bytes(view[pos + 9:stop]))
                    if conn.phase != _READY:
                        return end
                else:
                    out += pack_answer(len(value) + 9, tag, 0)
                    out += pack_u32(len(value))
                    out += value
            else:
                self._request(conn, op, tag, bytes(view[pos + 9:stop]))
                if conn.phase != _READY:
                    return end
            pos = stop
            if len(out) > OUT_LIMIT:  # back-pressure: read no more until the client reads its answers
                conn.paused = True
                self._set_events(conn, _OUT)
                break
        return pos

    # --- handshake ------------------------------------------------------------

    def _read_handshake(self, conn: _Conn) -> None:
        """Read only what the handshake's next message may be: nothing larger
        is buffered for a peer that has not proven it knows the secret."""
        want = (P.HELLO_SIZE if conn.phase == _HELLO else _PROOF_FRAME) - len(conn.inbuf)
        try:
            chunk = conn.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return
        inbuf = conn.inbuf
        inbuf += chunk
        if conn.phase == _HELLO:
            if not P.MAGIC.startswith(bytes(inbuf[:len(P.MAGIC)])):
                log.debug("%r: closing %s: not a store client", self, conn.peer)
                self._close(conn)
            elif len(inbuf) == P.HELLO_SIZE:
                self._hello(conn, bytes(inbuf))
                inbuf.clear()
                self._flush(conn)
            return
        if len(inbuf) < 4:
            return
        (n,) = P.U32.unpack_from(inbuf)
        if n > P.PROOF_SIZE:
            self._fail(conn, f"handshake frame of {n} bytes; an authentication proof has at most "
                             f"{P.PROOF_SIZE} (is the client of another nccl_pg version?)")
        elif len(inbuf) >= 4 + n:
            proof = bytes(inbuf[4:4 + n])
            del inbuf[:4 + n]  # what follows (requests sent early) waits until the proof is checked
            self._auth(conn, proof)
            if conn.phase == _READY and inbuf:
                self._process_inbuf(conn)
        self._flush(conn)

    def _hello(self, conn: _Conn, hello: bytes) -> None:
        conn.client_nonce = hello[len(P.MAGIC):]
        conn.server_nonce = os.urandom(P.NONCE_SIZE)
        if self._secret:
            flags = P.FLAG_AUTH
            server_proof = P.proof(self._secret, b"server", conn.client_nonce, conn.server_nonce)
        else:
            flags, server_proof = 0, bytes(P.PROOF_SIZE)
        conn.out += P.frame(P.SERVER_HELLO.pack(conn.server_nonce, flags, self.max_value_size, self.idle_timeout,
                                                server_proof))
        conn.phase = _AUTH

    def _auth(self, conn: _Conn, client_proof: bytes) -> None:
        if self._secret:
            expected = P.proof(self._secret, b"client", conn.server_nonce, conn.client_nonce)
            if not hmac.compare_digest(client_proof, expected):
                why = "no secret given" if not client_proof else "wrong secret"
                self._fail(conn, f"authentication failed ({why}); set NCCL_PG_STORE_SECRET to the server's secret")
                return
        conn.phase = _READY
        conn.last_active = self._now
        conn.out += P.answer(P.CONNECTION_TAG, P.Status.OK)

    def _sweep(self, now: float) -> None:
        idle = self.idle_timeout
        for conn in list(self._conns.values()):
            if conn.phase < _READY:
                if conn.deadline < now:
                    log.debug("%r: dropping %s: no handshake within %.1f s", self, conn.peer,
                              self._handshake_timeout)
                    self._close(conn)
            elif (idle and conn.phase == _READY and not conn.waiters and not conn.out
                  and now - conn.last_active > idle):
                conn.out += P.answer(P.CONNECTION_TAG, P.Status.GOAWAY,
                                     P.pack_bytes(f"idle for more than {idle:g} s".encode()))
                conn.phase = _CLOSING
                self._flush(conn)

    # --- requests ---------------------------------------------------------------

    def _request(self, conn: _Conn, op: int, tag: int, body: bytes) -> None:
        handler = self._handlers.get(op)
        if handler is None:
            self._fail(conn, f"malformed request: unknown op {op}")
            return
        r = P.Reader(body)
        try:
            reply = handler(conn, tag, r)
        except ValueError as exc:  # malformed: the stream cannot be trusted any more
            self._fail(conn, f"malformed request: {exc}")
            return
        except DistStoreError as exc:
            self._answer(conn, tag, P.Status.ERROR, P.pack_bytes(str(exc).encode()))
            return
        if reply is not None:
            self._answer(conn, tag, P.Status.OK, reply)

    def _check_size(self, key: str, value: bytes) -> bytes:
        if len(value) > self.max_value_size:
            raise DistStoreError(f"value for key {key!r} is {len(value)} bytes, over the store's limit of "
                                 f"{self.max_value_size} bytes (NCCL_PG_STORE_MAX_VALUE_SIZE)")
        return value

    def _get(self, conn: _Conn, tag: int, r: P.Reader) -> bytes | None:
        key, timeout = r.str(), r.f64()
        r.end()
        return self._blocking(conn, tag, P.Op.GET, [key], timeout)

    def _wait(self, conn: _Conn, tag: int, r: P.Reader) -> bytes | None:
        keys, timeout = r.str_list(), r.f64()
        r.end()
        return self._blocking(conn, tag, P.Op.WAIT, keys, timeout)

    def _multi_get(self, conn: _Conn, tag: int, r: P.Reader) -> bytes | None:
        keys, timeout = r.str_list(), r.f64()
        r.end()
        return self._blocking(conn, tag, P.Op.MULTI_GET, keys, timeout)

    def _queue_pop(self, conn: _Conn, tag: int, r: P.Reader) -> bytes | None:
        key, timeout = r.str(), r.f64()
        r.end()
        value = self._state.queue_pop(key)
        if value is not None:
            return P.pack_bytes(value)
        if timeout == 0:
            self._answer(conn, tag, P.Status.EMPTY)
            return None
        return self._blocking(conn, tag, P.Op.QUEUE_POP, [key], timeout)

    def _blocking(self, conn: _Conn, tag: int, op: int, keys: list[str], timeout: float) -> bytes | None:
        """Answer now if the keys are there, else park a waiter."""
        if not timeout > 0 or math.isinf(timeout) or math.isnan(timeout):
            raise ValueError(f"timeout must be finite and > 0, got {timeout}")
        if op != _QUEUE_POP:
            missing = self._missing(op, keys)
            if not missing:
                return self._reply_to(op, keys)
        else:
            missing = keys
        if len(conn.waiters) >= MAX_WAITERS:
            raise DistStoreError(f"{MAX_WAITERS} requests of this connection are blocked already; "
                                 f"refusing another")
        w = _Waiter(conn, tag, op, keys, self._now + timeout)
        conn.waiters.add(w)
        self._live_waiters += 1
        self._park(w, missing)
        heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))
        return None

    def _missing(self, op: int, keys: list[str]) -> list[str]:
        # wait counts a non-empty queue as the key's presence; get and multi_get need values
        return self._state.missing(keys) if op == _WAIT else self._state.missing_values(keys)

    def _park(self, w: _Waiter, keys: Iterable[str]) -> None:
        waiting = self._waiting
        for key in dict.fromkeys(keys):  # once per key, however often it was asked for
            ws = waiting.get(key)
            if ws is None:
                waiting[key] = {w: None}
            else:
                ws[w] = None
            w.pending += 1

    def _reply_to(self, op: int, keys: list[str]) -> bytes:
        data = self._state.data
        if op == P.Op.GET:
            return P.pack_bytes(data[keys[0]])
        if op == P.Op.MULTI_GET:
            reply = P.pack_list([data[k] for k in keys])
            if len(reply) > self._max_frame:
                raise DistStoreError(f"multi_get answer of {len(reply)} bytes is over the store's frame limit "
                                     f"of {self._max_frame} bytes; ask for fewer keys at a time")
            return reply
        return b""

    def _add(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        key, amount = r.str(), r.i64()
        r.end()
        value = self._state.add(key, amount)
        self._notify(key)
        return P.I64.pack(value)

    def _compare_set(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        key, expected = r.str(), r.bytes()
        desired = self._check_size(key, r.bytes())
        r.end()
        result = self._state.compare_set(key, expected, desired)
        self._notify(key)
        return P.pack_bytes(result)

    def _check(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        keys = r.str_list()
        r.end()
        return P.I64.pack(0 if self._state.missing(keys) else 1)

    def _delete(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        key = r.str()
        r.end()
        return P.I64.pack(int(self._state.delete(key)))

    def _num_keys(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        r.end()
        return P.I64.pack(self._state.num_keys())

    def _list_keys(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        r.end()
        reply = P.pack_list([k.encode() for k in self._state.list_keys()])
        if len(reply) > self._max_frame:
            raise DistStoreError(f"list_keys answer of {len(reply)} bytes is over the store's frame limit")
        return reply

    def _multi_set(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        keys, values = r.str_list(), r.list()
        r.end()
        if len(keys) != len(values):
            raise ValueError("multi_set with different numbers of keys and values")
        for key, value in zip(keys, values, strict=True):
            self._check_size(key, value)
        self._state.data.update(zip(keys, values, strict=True))
        for key in keys:
            self._notify(key)
        return b""

    def _append(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        key, value = r.str(), r.bytes()
        r.end()
        self._check_size(key, self._state.data.get(key, b"") + value)
        self._state.append(key, value)
        self._notify(key)
        return b""

    def _ping(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        r.end()
        return b""

    def _queue_push(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        key, value = r.str(), r.bytes()
        r.end()
        self._check_size(key, value)
        self._state.queue_push(key, value)
        self._notify(key)
        return b""

    def _queue_len(self, conn: _Conn, tag: int, r: P.Reader) -> bytes:
        key = r.str()
        r.end()
        return P.I64.pack(self._state.queue_len(key))

    # --- waiters ------------------------------------------------------------------

    def _notify(self, key: str) -> None:
        """``key`` got a value or a queue item: answer the waiters it completes."""
        ws = self._waiting.pop(key, None)
        if not ws:
            return
        state = self._state
        for w in ws:
            w.pending -= 1
            if w.op == _QUEUE_POP:
                value = state.queue_pop(key)
                if value is None:  # an earlier waiter took it, or it was a value, not a queue item
                    self._park(w, (key,))
                else:
                    self._resolve(w, P.Status.OK, P.pack_bytes(value))
                continue
            if w.pending:
                continue
            missing = self._missing(w.op, w.keys)  # once per waiter: a key may have been deleted since
            if missing:
                self._park(w, missing)
                continue
            try:
                reply = self._reply_to(w.op, w.keys)
            except DistStoreError as exc:
                self._resolve(w, P.Status.ERROR, P.pack_bytes(str(exc).encode()))
            else:
                self._resolve(w, P.Status.OK, reply)

    def _forget(self, w: _Waiter) -> None:
        """Take ``w`` out of every key's list it is still in."""
        waiting = self._waiting
        if w.pending:
            for key in w.keys:
                ws = waiting.get(key)
                if ws is not None and w in ws:
                    del ws[w]
                    if not ws:
                        del waiting[key]
        w.pending = 0

    def _resolve(self, w: _Waiter, status: P.Status, payload: bytes) -> None:
        w.done = True
        self._live_waiters -= 1
        self._dead_in_heap += 1
        conn = w.conn
        conn.waiters.discard(w)
        if not conn.closed:
            self._answer(conn, w.tag, status, payload)
            self._dirty[conn] = None

    def _expire_waiters(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, w = heapq.heappop(heap)
            if w.done:
                self._dead_in_heap -= 1
                continue
            self._forget(w)
            if w.op == _QUEUE_POP:
                missing = w.keys
            else:
                missing = self._missing(w.op, w.keys)
            self._resolve(w, P.Status.TIMEOUT, P.pack_list([k.encode() for k in missing]))
            self._dead_in_heap -= 1
        if self._dead_in_heap > 1024 and self._dead_in_heap > len(heap) // 2:  # answered long before their deadline
            self._deadlines = [e for e in heap if not e[2].done]
            heapq.heapify(self._deadlines)
            self._dead_in_heap = 0

    # --- output and teardown -----------------------------------------------

    def _answer(self, conn: _Conn, tag: int, status: P.Status, payload: bytes = b"") -> None:
        out = conn.out
        out += P.ANSWER_HEAD.pack(len(payload) + 5, tag, status)
        out += payload

    def _fail(self, conn: _Conn, message: str) -> None:
        """Send a fatal error and close once it is written."""
        log.debug("%r: closing %s: %s", self, conn.peer, message)
        self._answer(conn, P.CONNECTION_TAG, P.Status.FATAL, P.pack_bytes(message.encode()))
        conn.phase = _CLOSING
        self._dirty[conn] = None

    def _set_events(self, conn: _Conn, events: int) -> None:
        if events != conn.events:
            conn.events = events
            self._poller.modify(conn.fd, events)

    def _flush(self, conn: _Conn) -> None:
        if conn.closed:
            return
        out = conn.out
        if out:
            try:
                sent = conn.sock.send(out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent:
                del out[:sent]
                conn.last_active = self._now
        if conn.phase != _READY:
            if conn.phase == _CLOSING and not out:
                self._close(conn)
            else:
                self._set_events(conn, _OUT if conn.phase == _CLOSING else (_IN | _OUT if out else _IN))
            return
        if conn.paused and len(out) <= OUT_LIMIT:  # the client read enough: go on with its requests
            conn.paused = False
            self._process_inbuf(conn)
            if out:
                self._dirty[conn] = None
        events = _OUT if conn.paused else (_IN | _OUT if out else _IN)
        if events != conn.events:
            conn.events = events
            self._poller.modify(conn.fd, events)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        for w in conn.waiters:  # forget them now: a dead client's keys may never be set
            self._forget(w)
            w.done = True
            w.keys = []
            self._live_waiters -= 1
            self._dead_in_heap += 1
        conn.waiters.clear()
        conn.inbuf = bytearray()
        conn.out = bytearray()
        self._conns.pop(conn.fd, None)
        self._dirty.pop(conn, None)
        try:
            self._poller.unregister(conn.fd)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
