"""TCPStore server: one thread, non-blocking sockets, an epoll/kqueue loop.

Blocking requests (get, wait, multi_get) never block the loop: they become
waiters that are answered when their keys are set or their deadline passes.
A connection with a waiter processes no further requests until it is
answered, so responses stay in request order. Bad clients cannot hurt the
others: garbage or an oversized frame closes that connection, a client that
never finishes the handshake is dropped after ``handshake_timeout``.
"""

from __future__ import annotations

import collections
import heapq
import hmac
import itertools
import logging
import math
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from .. import env
from ..errors import DistNetworkError, DistStoreError
from . import protocol as P
from .base import KeyValueState

log = logging.getLogger(__name__)

_RECV_SIZE = 256 * 1024


@dataclass(eq=False)
class _Waiter:
    conn: _Conn
    op: P.Op
    keys: list[str]
    deadline: float
    done: bool = False


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    deadline: float  # handshake deadline; inf once authenticated
    phase: str = "hello"  # hello -> auth -> ready -> closing
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)
    client_nonce: bytes = b""
    server_nonce: bytes = b""
    waiter: _Waiter | None = None
    writing: bool = False
    closed: bool = False


def _listen(host: str, port: int, backlog: int) -> socket.socket:
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
    inside rank 0 or the launcher, or in the foreground (``serve_forever()``)."""

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 0,
        secret: str | bytes | None = None,
        max_value_size: int | None = None,
        handshake_timeout: float = 10.0,
        backlog: int = 4096,
    ) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if secret is None:
            secret = env.STORE_SECRET.get()
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self.max_value_size = env.STORE_MAX_VALUE_SIZE.get() if max_value_size is None else max_value_size
        if not isinstance(self.max_value_size, int) or self.max_value_size < 1:
            raise ValueError(f"max_value_size must be a positive int, got {self.max_value_size!r}")
        self._max_frame = self.max_value_size + P.FRAME_OVERHEAD
        self._handshake_timeout = handshake_timeout
        self._listener = _listen(host, port, backlog)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._state = KeyValueState()
        self._waiting: dict[str, set[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._conns: set[_Conn] = set()
        self._requests: collections.Counter[str] = collections.Counter()  # by command, for stats()
        self._sel = selectors.DefaultSelector()
        # One receive buffer for every connection (the loop is single-threaded):
        # recv(n) would allocate, and for n this large mmap/munmap, per request.
        self._rbuf = memoryview(bytearray(_RECV_SIZE))
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
        """Blocked get/wait/multi_get requests not yet answered."""
        return len({w for ws in self._waiting.values() for w in ws if not w.done})

    def stats(self) -> dict[str, int]:
        """Requests served so far, by command name ("set", "wait", ...)."""
        return dict(self._requests)

    def start(self) -> TCPStoreServer:
        self._serving = True
        self._thread = threading.Thread(target=self.serve_forever, name="nccl_pg-store-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
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
        elif self._thread is None:
            self._finished.wait(timeout)

    def __enter__(self) -> TCPStoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the loop -----------------------------------------------------------

    def serve_forever(self) -> None:
        self._serving = True
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        next_sweep = time.monotonic() + 1.0
        try:
            while not self._stopping:
                now = time.monotonic()
                wait = min(next_sweep, self._deadlines[0][0] if self._deadlines else math.inf) - now
                for key, mask in self._sel.select(max(wait, 0.0)):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(4096)
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ and not conn.closed:
                            self._on_readable(conn)
                now = time.monotonic()
                self._expire_waiters(now)
                if now >= next_sweep:
                    self._drop_stalled_handshakes(now)
                    next_sweep = now + 1.0
        finally:
            for conn in list(self._conns):
                self._close(conn)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            self._finished.set()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: keep serving the clients we have
                log.warning("%r: accept failed: %s", self, exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", time.monotonic() + self._handshake_timeout)
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            n = conn.sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:
            self._close(conn)
            return
        conn.inbuf += self._rbuf[:n]
        self._process(conn)
        self._flush(conn)

    def _process(self, conn: _Conn) -> None:
        buf = conn.inbuf
        pos = 0
        try:
            while conn.waiter is None and conn.phase != "closing":
                if conn.phase == "hello":
                    if len(buf) - pos < P.HELLO_SIZE:
                        break
                    self._hello(conn, bytes(buf[pos:pos + P.HELLO_SIZE]))
                    pos += P.HELLO_SIZE
                    continue
                if len(buf) - pos < 4:
                    break
                (n,) = P.U32.unpack_from(buf, pos)
                if n > self._max_frame:
                    self._fail(conn, f"frame of {n} bytes exceeds the limit of {self._max_frame} bytes "
                                     f"(max value size {self.max_value_size}, NCCL_PG_STORE_MAX_VALUE_SIZE)")
                    break
                if len(buf) - pos < 4 + n:
                    break
                body = memoryview(buf)[pos + 4:pos + 4 + n]
                try:
                    if conn.phase == "auth":
                        self._auth(conn, bytes(body))
                    else:
                        self._request(conn, body)
                finally:
                    body.release()
                pos += 4 + n
        finally:
            del buf[:pos]

    # --- handshake ------------------------------------------------------------

    def _hello(self, conn: _Conn, hello: bytes) -> None:
        if not hello.startswith(P.MAGIC):
            log.debug("%r: closing %s: not a store client", self, conn.peer)
            self._close(conn)
            conn.phase = "closing"
            return
        conn.client_nonce = hello[len(P.MAGIC):]
        conn.server_nonce = os.urandom(P.NONCE_SIZE)
        if self._secret:
            flags = P.FLAG_AUTH
            server_proof = P.proof(self._secret, b"server", conn.client_nonce, conn.server_nonce)
        else:
            flags, server_proof = 0, bytes(P.PROOF_SIZE)
        conn.out += P.frame(P.SERVER_HELLO.pack(conn.server_nonce, flags, self.max_value_size, server_proof))
        conn.phase = "auth"

    def _auth(self, conn: _Conn, client_proof: bytes) -> None:
        if self._secret:
            expected = P.proof(self._secret, b"client", conn.server_nonce, conn.client_nonce)
            if not hmac.compare_digest(client_proof, expected):
                why = "no secret given" if not client_proof else "wrong secret"
                self._fail(conn, f"authentication failed ({why}); set NCCL_PG_STORE_SECRET to the server's secret")
                return
        conn.phase = "ready"
        conn.deadline = math.inf
        conn.out += P.frame(bytes([P.Status.OK]))

    def _drop_stalled_handshakes(self, now: float) -> None:
        for conn in [c for c in self._conns if c.deadline < now]:
            log.debug("%r: dropping %s: no handshake within %.1f s", self, conn.peer, self._handshake_timeout)
            self._close(conn)

    # --- requests ---------------------------------------------------------------

    def _request(self, conn: _Conn, body: memoryview) -> None:
        r = P.Reader(body, 1)
        try:
            op = P.Op(body[0]) if len(body) else None
            if op is None:
                raise ValueError("empty request")
            self._requests[op.name.lower()] += 1
            reply = self._dispatch(conn, op, r)
        except ValueError as exc:  # malformed: the stream cannot be trusted any more
            self._fail(conn, f"malformed request: {exc}")
            return
        except DistStoreError as exc:
            self._reply(conn, P.Status.ERROR, P.pack_bytes(str(exc).encode()))
            return
        if reply is not None:
            self._reply(conn, P.Status.OK, reply)

    def _check_size(self, key: str, value: bytes) -> bytes:
        if len(value) > self.max_value_size:
            raise DistStoreError(f"value for key {key!r} is {len(value)} bytes, over the store's limit of "
                                 f"{self.max_value_size} bytes (NCCL_PG_STORE_MAX_VALUE_SIZE)")
        return value

    def _dispatch(self, conn: _Conn, op: P.Op, r: P.Reader) -> bytes | None:
        state = self._state
        if op is P.Op.SET:
            key = r.str()
            value = self._check_size(key, r.bytes())
            r.end()
            state.data[key] = value
            self._notify((key,))
            return b""
        if op is P.Op.ADD:
            key, amount = r.str(), r.i64()
            r.end()
            value = state.add(key, amount)
            self._notify((key,))
            return P.I64.pack(value)
        if op in (P.Op.GET, P.Op.WAIT, P.Op.MULTI_GET):
            keys = [r.str()] if op is P.Op.GET else r.str_list()
            timeout = r.f64()
            r.end()
            if not timeout > 0 or math.isinf(timeout) or math.isnan(timeout):
                raise ValueError(f"timeout must be finite and > 0, got {timeout}")
            missing = state.missing(keys)
            if not missing:
                return self._answer(op, keys)
            waiter = _Waiter(conn, op, keys, time.monotonic() + timeout)
            conn.waiter = waiter
            for key in missing:
                self._waiting.setdefault(key, set()).add(waiter)
            heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))
            return None
        if op is P.Op.COMPARE_SET:
            key, expected = r.str(), r.bytes()
            desired = self._check_size(key, r.bytes())
            r.end()
            result = state.compare_set(key, expected, desired)
            self._notify((key,))
            return P.pack_bytes(result)
        if op is P.Op.CHECK:
            keys = r.str_list()
            r.end()
            return P.I64.pack(0 if state.missing(keys) else 1)
        if op is P.Op.DELETE:
            key = r.str()
            r.end()
            return P.I64.pack(int(state.data.pop(key, None) is not None))
        if op is P.Op.NUM_KEYS:
            r.end()
            return P.I64.pack(state.num_keys())
        if op is P.Op.MULTI_SET:
            keys, values = r.str_list(), r.list()
            r.end()
            if len(keys) != len(values):
                raise ValueError("multi_set with different numbers of keys and values")
            for key, value in zip(keys, values, strict=False):
                self._check_size(key, value)
            state.data.update(zip(keys, values, strict=False))
            self._notify(keys)
            return b""
        if op is P.Op.APPEND:
            key, value = r.str(), r.bytes()
            r.end()
            self._check_size(key, state.data.get(key, b"") + value)
            state.append(key, value)
            self._notify((key,))
            return b""
        if op is P.Op.PING:
            r.end()
            return b""
        raise ValueError(f"unknown op {op}")

    def _answer(self, op: P.Op, keys: list[str]) -> bytes:
        data = self._state.data
        if op is P.Op.GET:
            return P.pack_bytes(data[keys[0]])
        if op is P.Op.MULTI_GET:
            return P.pack_list([data[k] for k in keys])
        return b""

    def _notify(self, keys: tuple[str, ...] | list[str]) -> None:
        for key in keys:
            waiters = self._waiting.pop(key, None)
            if not waiters:
                continue
            for w in waiters:
                if w.done:
                    continue
                missing = self._state.missing(w.keys)
                if missing:  # a key it had seen was deleted again: keep waiting for it
                    for k in missing:
                        self._waiting.setdefault(k, set()).add(w)
                    continue
                self._resolve(w, P.Status.OK, self._answer(w.op, w.keys))

    def _expire_waiters(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if not w.done:
                self._resolve(w, P.Status.TIMEOUT, P.pack_list([k.encode() for k in self._state.missing(w.keys)]))

    def _resolve(self, w: _Waiter, status: P.Status, payload: bytes) -> None:
        w.done = True
        conn = w.conn
        conn.waiter = None
        if conn.closed:
            return
        self._reply(conn, status, payload)
        self._process(conn)  # requests that queued up behind the waiter
        self._flush(conn)

    # --- output and teardown -----------------------------------------------

    def _reply(self, conn: _Conn, status: P.Status, payload: bytes) -> None:
        conn.out += P.U32.pack(len(payload) + 1)
        conn.out.append(status)
        conn.out += payload

    def _fail(self, conn: _Conn, message: str) -> None:
        """Send a fatal error and close once it is written."""
        log.debug("%r: closing %s: %s", self, conn.peer, message)
        self._reply(conn, P.Status.FATAL, P.pack_bytes(message.encode()))
        conn.phase = "closing"

    def _flush(self, conn: _Conn) -> None:
        if conn.closed:
            return
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
                del conn.out[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(conn)
                return
        if not conn.out and conn.phase == "closing":
            self._close(conn)
            return
        want_write = bool(conn.out)
        if want_write != conn.writing:
            conn.writing = want_write
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0)
            self._sel.modify(conn.sock, events, conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        w = conn.waiter
        if w is not None:  # forget it now: a dead client's keys may never be set
            w.done = True
            for key in w.keys:
                waiters = self._waiting.get(key)
                if waiters is not None:
                    waiters.discard(w)
                    if not waiters:
                        del self._waiting[key]
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
