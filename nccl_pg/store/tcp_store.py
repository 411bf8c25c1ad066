"""TCPStore client (and, with ``is_master=True``, the server in a thread).

Each thread that uses a TCPStore gets its own connection, so a thread blocked
in ``wait()`` never delays another thread's ``set()``. Every call has a
deadline: waits are answered by the server at theirs, and the client gives up
on a silent server a little later.
"""

from __future__ import annotations

import math
import os
import select
import socket
import threading
import time
from collections.abc import Sequence

from .. import env
from ..errors import DistNetworkError, DistStoreError
from . import protocol as P
from .base import (
    RESERVED_PREFIX,
    Backoff,
    Store,
    Timeout,
    Value,
    as_seconds,
    check_amount,
    check_key,
    check_keys,
    check_multi_set,
    timeout_error,
    to_bytes,
)
from .tcp_server import TCPStoreServer

_WORKERS_KEY = RESERVED_PREFIX + "workers"
_WORKERS_READY_KEY = RESERVED_PREFIX + "workers_ready"
# How long past a wait's own deadline the client waits for the server's answer.
_ANSWER_GRACE = 5.0
# Below glibc's mmap threshold, so a small answer costs no mmap/munmap;
# a large value is read in chunks of up to _RECV_MAX.
_RECV_SIZE = 64 * 1024
_RECV_MAX = 1 << 20


class _Connection:
    """One authenticated socket to the server, used by one thread."""

    def __init__(self, store: TCPStore, deadline: float) -> None:
        self.store = store
        self.buf = bytearray()
        self.sock = self._connect(deadline)
        # Non-blocking with our own poll(): settimeout() per call would cost an
        # ioctl and a poll per send and per recv.
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()  # by number: a socket closed by another thread must not raise ValueError
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLIN)
        try:
            self.max_value_size = self._handshake(deadline)
        except TimeoutError:
            self.sock.close()
            raise DistNetworkError(f"timeout: store server {store.address} did not complete the handshake") from None
        except OSError as exc:
            self.sock.close()
            raise DistNetworkError(f"connection to store server {store.address} lost during the handshake: {exc}") from None
        except BaseException:
            self.sock.close()
            raise

    def _connect(self, deadline: float) -> socket.socket:
        store = self.store
        backoff = Backoff(deadline, first=0.01, cap=1.0)
        while True:
            try:
                sock = socket.create_connection((store.host, store.port), timeout=max(deadline - time.monotonic(), 0.01))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as exc:
                # Before the first success the server may simply not be up yet;
                # afterwards a refusal means it is gone, and retrying would hang.
                if store._ever_connected and isinstance(exc, ConnectionRefusedError):
                    raise DistNetworkError(
                        f"store server {store.address} is gone (connection refused); it was reachable before"
                    ) from None
                last = exc
            if not backoff.sleep():
                raise DistNetworkError(
                    f"timeout: could not connect to store server {store.address} within "
                    f"{store.connect_timeout:.1f} s: {last}"
                ) from None

    def _handshake(self, deadline: float) -> int:
        store = self.store
        client_nonce = os.urandom(P.NONCE_SIZE)
        self.send(P.MAGIC + client_nonce, deadline)
        hello = self.recv_frame(deadline, "handshake")
        try:
            server_nonce, flags, max_value_size, server_proof = P.SERVER_HELLO.unpack(hello)
        except Exception:
            raise DistNetworkError(f"{store.address} did not answer like a TCPStore server") from None
        secret = store._secret
        if secret:
            if not flags & P.FLAG_AUTH:
                raise DistStoreError(
                    f"store server {store.address} does not use authentication but this client has a secret "
                    f"(NCCL_PG_STORE_SECRET); refusing to trust it"
                )
            if server_proof != P.proof(secret, b"server", client_nonce, server_nonce):
                raise DistStoreError(
                    f"authentication failed: store server {store.address} does not know this client's secret "
                    f"(NCCL_PG_STORE_SECRET differs between client and server)"
                )
            client_proof = P.proof(secret, b"client", server_nonce, client_nonce)
        else:
            client_proof = b""
        self.send(P.frame(client_proof), deadline)
        self.result(self.recv_frame(deadline, "handshake"), "handshake", [])
        store._ever_connected = True
        return max_value_size

    def _poll(self, event: int, deadline: float) -> None:
        """Wait until the socket is ready for ``event``; TimeoutError at ``deadline``."""
        self.poller.modify(self.fd, event)
        if not self.poller.poll(max(math.ceil((deadline - time.monotonic()) * 1000), 1)):
            raise TimeoutError

    def send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:
                self._poll(select.POLLOUT, deadline)

    def recv_frame(self, deadline: float, op: str) -> bytes:
        buf = self.buf
        while True:
            want = 0
            if len(buf) >= 4:
                n = 4 + P.U32.unpack_from(buf)[0]
                if len(buf) >= n:
                    break
                want = n - len(buf)
            self._poll(select.POLLIN, deadline)
            try:
                chunk = self.sock.recv(min(max(want, _RECV_SIZE), _RECV_MAX))
            except BlockingIOError:  # spurious wake-up
                continue
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            buf += chunk
        body = bytes(buf[4:n])
        del buf[:n]
        return body

    def result(self, body: bytes, op: str, keys: list[str], waited: float = 0.0) -> P.Reader:
        status = body[0] if body else P.Status.ERROR
        r = P.Reader(body, 1)
        if status == P.Status.OK:
            return r
        if status == P.Status.TIMEOUT:
            raise timeout_error(f"{self.store!r}.{op}", keys, r.str_list(), waited)
        message = r.str() if len(body) > 1 else "malformed answer"
        if status == P.Status.FATAL:  # the server is closing this connection: do not reuse it
            self.store._drop(self)
        raise DistStoreError(f"store server {self.store.address} refused {op}: {message}")


class TCPStore(Store):
    """A client of a TCPStoreServer; with ``is_master=True`` it also starts
    the server (in a daemon thread of this process) on ``port`` (0: any free
    port; read it back from ``.port``).

    With ``world_size`` set, every client registers; the master's constructor
    waits until ``world_size`` clients have (``wait_for_workers``).
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = 300.0,
        wait_for_workers: bool = True,
        secret: str | bytes | None = None,
        max_value_size: int | None = None,
        connect_timeout: Timeout | None = None,
    ) -> None:
        super().__init__(timeout)
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise ValueError(f"world_size must be a positive int or None, got {world_size!r}")
        if secret is None:
            secret = env.STORE_SECRET.get()
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self.connect_timeout = self.timeout if connect_timeout is None else as_seconds(connect_timeout, "connect_timeout")
        self._server = TCPStoreServer(host_name, port, self._secret, max_value_size) if is_master else None
        if self._server is not None:
            self._server.start()
            port = self._server.port
        elif not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"port must be an int in 1..65535, got {port!r}")
        self.host, self.port = host_name, port
        self.world_size = world_size
        self._ever_connected = False
        self._local = threading.local()
        self._conns: list[_Connection] = []
        self._conns_lock = threading.Lock()
        self._closed = False
        try:
            self._conn()
            if world_size is not None:
                self._register_worker(world_size, is_master and wait_for_workers)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"TCPStore({self.address})"

    @property
    def server(self) -> TCPStoreServer | None:
        return self._server

    def clone(self) -> TCPStore:
        """Another client of the same server (never a server itself)."""
        return TCPStore(self.host, self.port, timeout=self.timeout, secret=self._secret,
                        connect_timeout=self.connect_timeout)

    def _register_worker(self, world_size: int, wait: bool) -> None:
        if self.add(_WORKERS_KEY, 1) == world_size:
            self.set(_WORKERS_READY_KEY, b"1")
        if wait:
            try:
                self.wait([_WORKERS_READY_KEY])
            except DistStoreError:
                n = self.add(_WORKERS_KEY, 0)
                raise DistStoreError(
                    f"timeout: only {n} of {world_size} workers connected to the store at {self.address} "
                    f"within {self.timeout:.1f} s"
                ) from None

    def _conn(self) -> _Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise DistStoreError(f"{self!r} is closed")
            conn = _Connection(self, time.monotonic() + self.connect_timeout)
            with self._conns_lock:
                self._conns.append(conn)
            self._local.conn = conn
        return conn

    def _drop(self, conn: _Connection) -> None:
        self._local.conn = None
        with self._conns_lock:
            if conn in self._conns:
                self._conns.remove(conn)
        conn.sock.close()

    def _call(self, body: bytes, op: str, keys: list[str], wait: float | None = None) -> P.Reader:
        """Send one request and return its decoded OK answer. ``wait`` is the
        server-side deadline of a blocking request."""
        conn = self._conn()
        limit = conn.max_value_size + P.FRAME_OVERHEAD
        if len(body) > limit:  # the server would drop the connection
            raise ValueError(f"{op} request of {len(body)} bytes is over the store's frame limit of {limit} bytes "
                             f"(max value size {conn.max_value_size} plus 1 MiB for keys)")
        start = time.monotonic()
        deadline = start + (wait if wait is not None else self.timeout) + _ANSWER_GRACE
        try:
            conn.send(P.frame(body), deadline)
            answer = conn.recv_frame(deadline, op)
        except TimeoutError:
            self._drop(conn)  # a late answer would desynchronise the stream
            raise DistStoreError(
                f"timeout: no answer from store server {self.address} to {op}({keys!r}) within "
                f"{deadline - start:.1f} s"
            ) from None
        except OSError as exc:
            self._drop(conn)
            if self._closed:
                raise DistStoreError(f"{self!r} was closed during {op}({keys!r})") from None
            raise DistNetworkError(
                f"connection to store server {self.address} lost during {op}({keys!r}): {exc}; "
                f"the server process may have exited"
            ) from None
        return conn.result(answer, op, keys, time.monotonic() - start)

    def _check_value(self, key: str, value: bytes) -> bytes:
        limit = self._conn().max_value_size
        if len(value) > limit:
            raise ValueError(f"value for key {key!r} is {len(value)} bytes, over the store's limit of {limit} bytes")
        return value

    # --- operations ---------------------------------------------------------

    def set(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = self._check_value(key, to_bytes(value, key))
        self._call(bytes([P.Op.SET]) + P.pack_bytes(key.encode()) + P.pack_bytes(value), "set", [key])

    def get(self, key: str) -> bytes:
        key = check_key(key)
        body = bytes([P.Op.GET]) + P.pack_bytes(key.encode()) + P.F64.pack(self.timeout)
        return self._call(body, "get", [key], self.timeout).bytes()

    def add(self, key: str, amount: int) -> int:
        key, amount = check_key(key), check_amount(amount)
        return self._call(bytes([P.Op.ADD]) + P.pack_bytes(key.encode()) + P.I64.pack(amount), "add", [key]).i64()

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = check_key(key)
        expected = to_bytes(expected, key)
        desired = self._check_value(key, to_bytes(desired, key))
        body = bytes([P.Op.COMPARE_SET]) + P.pack_bytes(key.encode()) + P.pack_bytes(expected) + P.pack_bytes(desired)
        return self._call(body, "compare_set", [key]).bytes()

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        keys = check_keys(keys)
        seconds = self._deadline(timeout)
        body = bytes([P.Op.WAIT]) + P.pack_list([k.encode() for k in keys]) + P.F64.pack(seconds)
        self._call(body, "wait", keys, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        return self._call(bytes([P.Op.CHECK]) + P.pack_list([k.encode() for k in keys]), "check", keys).i64() == 1

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        return self._call(bytes([P.Op.DELETE]) + P.pack_bytes(key.encode()), "delete_key", [key]).i64() == 1

    def num_keys(self) -> int:
        return self._call(bytes([P.Op.NUM_KEYS]), "num_keys", []).i64()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        body = bytes([P.Op.MULTI_GET]) + P.pack_list([k.encode() for k in keys]) + P.F64.pack(self.timeout)
        return self._call(body, "multi_get", keys, self.timeout).list()

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        keys, data = check_multi_set(keys, values)
        for key, value in zip(keys, data, strict=False):
            self._check_value(key, value)
        body = bytes([P.Op.MULTI_SET]) + P.pack_list([k.encode() for k in keys]) + P.pack_list(data)
        self._call(body, "multi_set", keys)

    def append(self, key: str, value: Value) -> None:
        key = check_key(key)
        value = self._check_value(key, to_bytes(value, key))
        self._call(bytes([P.Op.APPEND]) + P.pack_bytes(key.encode()) + P.pack_bytes(value), "append", [key])

    def local_address(self) -> str:
        """This host's address on the connection to the server: the interface
        that reaches the other hosts."""
        return self._conn().sock.getsockname()[0]

    def ping(self) -> float:
        """Round-trip time to the server in seconds."""
        start = time.perf_counter()
        self._call(bytes([P.Op.PING]), "ping", [])
        return time.perf_counter() - start

    def close(self) -> None:
        self._closed = True
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv; close() alone does not
            except OSError:
                pass
            conn.sock.close()
        self._local = threading.local()
        if self._server is not None:
            self._server.stop()
