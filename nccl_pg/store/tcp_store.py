"""TCPStore client (and, with ``is_master=True``, the server in a thread).

A TCPStore, its clones and every PrefixStore over them share ONE connection
to the server (``tcp_connection``), whatever the number of threads that use
them: a thread parked in ``wait()`` never delays another thread's ``set()``,
and a parked wait costs no traffic.

Every call has a deadline of its own, which nothing another thread does on
the connection can stretch or cut: waits are answered by the server at
theirs, and the client gives up on a silent server a little later (see
``_grace``); a call that times out fails alone, the connection and the other
calls go on.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Sequence

from .. import env
from ..errors import DistError, DistNetworkError, DistStoreError, QueueEmptyError
from ..timeouts import Timeout, to_seconds
from . import protocol as P
from .base import (
    COUNTED_PREFIX,
    HIDDEN_PREFIX,
    OwnParking,
    Parking,
    Store,
    Value,
    check_amount,
    check_key,
    check_keys,
    check_multi_set,
    fork_count,
    timeout_error,
    to_bytes,
)
from .tcp_connection import Broken, CallTimeout, Client, Retry
from .tcp_server import TCPStoreServer

_WORKERS_KEY = COUNTED_PREFIX + "workers"  # counted by num_keys(), as torch's worker counter
_WORKERS_READY_KEY = HIDDEN_PREFIX + "workers_ready"
# How long past its own deadline a request waits for the server's answer: the server ends a wait at its
# deadline and answers at once, so this only covers the round trip and a busy server's queue.
_ANSWER_GRACE = 5.0
# A wait that changes nothing at the server (wait, get, multi_get) gives up sooner on a silent server: a
# short wait fails near its own deadline. The others keep the full grace: an answer dropped late may carry
# what the request changed (the item a queue_pop took).
_WAIT_GRACE_MIN, _WAIT_GRACE_SHARE = 0.25, 0.1
_SET_HEAD_PACK = struct.Struct("<IBII").pack  # frame length, op, tag, key length
_U32_PACK, _F64_PACK, _I64_PACK, _I64_UNPACK = P.U32.pack, P.F64.pack, P.I64.pack, P.I64.unpack_from
# Plain ints: packing an IntEnum costs a conversion per request.
_OP_SET, _OP_GET, _OP_ADD = int(P.Op.SET), int(P.Op.GET), int(P.Op.ADD)
_READ_ONLY_WAITS = frozenset({_OP_GET, int(P.Op.WAIT), int(P.Op.MULTI_GET)})
_ONE = P.I64.pack(1)
_MAX_KEY = P.FRAME_OVERHEAD - 64  # a key must leave room for the frame's other fields

# multi_tenant masters of this process: (host, port) -> [server, users]
_tenants: dict[tuple[str, int], list] = {}
_tenants_lock = threading.Lock()


class TCPStore(Store):
    """A client of a TCPStoreServer; with ``is_master=True`` it also starts
    the server (in a daemon thread of this process) on ``port`` (0: any free
    port; read it back from ``.port``).

    torch's constructor arguments are accepted: ``world_size`` (every client
    registers; with ``wait_for_workers`` the master's constructor waits for
    that many), ``multi_tenant`` (masters of one process on the same address
    share one server), ``master_listen_fd`` (serve on this already bound
    socket), ``use_libuv`` (our server is neither of torch's: it only sets
    ``libuvBackend``, which torch code reads, and has what torch's libuv
    server has: queues, ``list_keys``).
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
        self._libuv = bool(use_libuv)
        self._client = Client(host_name, port, secret_bytes, self.connect_timeout)
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
    def libuvBackend(self) -> bool:  # noqa: N802 (torch's name)
        """torch's attribute: ``use_libuv`` as given (torch code reads it; our server is the same either way)."""
        return self._libuv

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
        self._client.share()
        return other

    def parking(self) -> Parking:
        """A wait on a connection of its own (made at first use), which
        ``close()`` ends at once without disturbing the calls of other
        threads on the shared connection."""
        other = object.__new__(TCPStore)
        other.__dict__.update(self.__dict__)
        other._server, other._tenant, other._closed = None, None, False
        c = self._client
        other._client = Client(c.host, c.port, c.secret, self.connect_timeout)
        return OwnParking(other)

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
        deadline = start + (self._timeout if wait is None else wait) + _grace(op, wait)
        for _ in range(3):
            conn = client.connection()
            try:
                body = conn.request(op, fields, deadline)
            except Retry:  # retired, or told to go away before it handled this: safe to send again
                continue
            except Broken as exc:
                raise self._broken(exc, what, keys) from None
            except CallTimeout as exc:
                raise self._late(exc, what, keys, wait is not None, time.monotonic() - start) from None
            if body[0] == P.Status.OK:
                return body
            raise self._refused(body, what, keys, time.monotonic() - start)
        raise DistNetworkError(f"store server {self.address} kept closing the connection during {what}({keys!r})")

    def _late(self, exc: CallTimeout, what: str, keys: list[str], waits: bool, waited: float) -> DistStoreError:
        """This call's deadline passed (the connection goes on)."""
        if exc.stage == "answer" and waits:
            return timeout_error(f"{self!r}.{what} (no answer from the server: frozen or overloaded?)", keys, [],
                                 waited)
        if exc.stage == "answer":
            why = "it was sent, but the server did not answer (frozen or overloaded?)"
        elif exc.stage == "send":
            why = ("nothing of it was sent: the server does not read what this connection sends (frozen or "
                   "overloaded?)")
        else:
            why = ("part of it was sent, the server stopped reading (frozen or overloaded?); the rest goes out "
                   "ahead of the next request on this connection, so the server may still apply it")
        return DistStoreError(f"timeout: {what}({keys!r}) on store server {self.address} did not complete within "
                              f"{waited:.1f} s: {why}")

    def _broken(self, exc: Broken, what: str, keys: list[str]) -> DistError:
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
        start = time.monotonic()
        for _ in range(3):
            if self._closed:
                raise DistStoreError(f"{self!r} is closed")
            try:
                client.connection().send(frame, start + self._timeout, True)
                return
            except Retry:
                continue
            except Broken as exc:
                raise self._broken(exc, "set", [key]) from None
            except CallTimeout as exc:
                raise self._late(exc, "set", [key], False, time.monotonic() - start) from None
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
        self._client.release()
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


def _grace(op: int, wait: float | None) -> float:
    """How long past its own deadline a request waits for the server's answer."""
    if wait is None or op not in _READ_ONLY_WAITS:
        return _ANSWER_GRACE
    return min(_ANSWER_GRACE, _WAIT_GRACE_MIN + _WAIT_GRACE_SHARE * wait)
