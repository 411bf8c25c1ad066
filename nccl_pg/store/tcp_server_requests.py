"""The TCPStore server's requests: a handler per op over the key-value state,
blocked requests parked as waiters until their keys are set or their deadline
passes, and answers appended to a connection's output for the loop to send.
The bottom part of TCPStoreServer (tcp_server.py); its connections' I/O is
tcp_server_io.py."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable

from ..errors import DistStoreError
from . import protocol as P
from .base import KeyValueState
from .tcp_server_sockets import CLOSING, Conn, Waiter

log = logging.getLogger("nccl_pg.store.tcp_server")

MAX_WAITERS = 4096  # blocked requests per connection
_QUEUE_POP = int(P.Op.QUEUE_POP)
_WAIT = int(P.Op.WAIT)


class ServerRequests:
    """The store's data, its waiters and the op handlers (see TCPStoreServer)."""

    def __init__(self, max_value_size: int) -> None:
        self.max_value_size = max_value_size
        self._max_frame = max_value_size + P.FRAME_OVERHEAD
        self._state = KeyValueState()
        self._waiting: dict[str, dict[Waiter, None]] = {}  # key -> waiters, oldest first
        self._live_waiters = 0
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._dead_in_heap = 0  # answered waiters still in _deadlines
        self._seq = itertools.count()
        self._dirty: dict[Conn, None] = {}  # connections with answers to send this turn
        self._counts = [0] * 256
        self._now = time.monotonic()
        self._handlers: dict[int, Callable[[Conn, int, P.Reader], bytes | None]] = {
            P.Op.GET: self._get, P.Op.ADD: self._add, P.Op.COMPARE_SET: self._compare_set,
            P.Op.WAIT: self._wait, P.Op.CHECK: self._check, P.Op.DELETE: self._delete,
            P.Op.NUM_KEYS: self._num_keys, P.Op.MULTI_GET: self._multi_get, P.Op.MULTI_SET: self._multi_set,
            P.Op.APPEND: self._append, P.Op.PING: self._ping, P.Op.QUEUE_PUSH: self._queue_push,
            P.Op.QUEUE_POP: self._queue_pop, P.Op.QUEUE_LEN: self._queue_len, P.Op.LIST_KEYS: self._list_keys,
        }

    # --- requests ---------------------------------------------------------------

    def _request(self, conn: Conn, op: int, tag: int, body: bytes) -> None:
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

    def _get(self, conn: Conn, tag: int, r: P.Reader) -> bytes | None:
        key, timeout = r.str(), r.f64()
        r.end()
        return self._blocking(conn, tag, P.Op.GET, [key], timeout)

    def _wait(self, conn: Conn, tag: int, r: P.Reader) -> bytes | None:
        keys, timeout = r.str_list(), r.f64()
        r.end()
        return self._blocking(conn, tag, P.Op.WAIT, keys, timeout)

    def _multi_get(self, conn: Conn, tag: int, r: P.Reader) -> bytes | None:
        keys, timeout = r.str_list(), r.f64()
        r.end()
        return self._blocking(conn, tag, P.Op.MULTI_GET, keys, timeout)

    def _queue_pop(self, conn: Conn, tag: int, r: P.Reader) -> bytes | None:
        key, timeout = r.str(), r.f64()
        r.end()
        value = self._state.queue_pop(key)
        if value is not None:
            return P.pack_bytes(value)
        if timeout == 0:
            self._answer(conn, tag, P.Status.EMPTY)
            return None
        return self._blocking(conn, tag, P.Op.QUEUE_POP, [key], timeout)

    def _blocking(self, conn: Conn, tag: int, op: int, keys: list[str], timeout: float) -> bytes | None:
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
        w = Waiter(conn, tag, op, keys, self._now + timeout)
        conn.waiters.add(w)
        self._live_waiters += 1
        self._park(w, missing)
        heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))
        return None

    def _missing(self, op: int, keys: list[str]) -> list[str]:
        # wait counts a non-empty queue as the key's presence; get and multi_get need values
        return self._state.missing(keys) if op == _WAIT else self._state.missing_values(keys)

    def _park(self, w: Waiter, keys: Iterable[str]) -> None:
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

    def _add(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
        key, amount = r.str(), r.i64()
        r.end()
        value = self._state.add(key, amount)
        self._notify(key)
        return P.I64.pack(value)

    def _compare_set(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
        key, expected = r.str(), r.bytes()
        desired = self._check_size(key, r.bytes())
        r.end()
        result = self._state.compare_set(key, expected, desired)
        self._notify(key)
        return P.pack_bytes(result)

    def _check(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
        keys = r.str_list()
        r.end()
        return P.I64.pack(0 if self._state.missing(keys) else 1)

    def _delete(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
        key = r.str()
        r.end()
        return P.I64.pack(int(self._state.delete(key)))

    def _num_keys(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
        r.end()
        return P.I64.pack(self._state.num_keys())

    def _list_keys(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
        r.end()
        reply = P.pack_list([k.encode() for k in self._state.list_keys()])
        if len(reply) > self._max_frame:
            raise DistStoreError(f"list_keys answer of {len(reply)} bytes is over the store's frame limit")
        return reply

    def _multi_set(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
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

    def _append(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
        key, value = r.str(), r.bytes()
        r.end()
        self._check_size(key, self._state.data.get(key, b"") + value)
        self._state.append(key, value)
        self._notify(key)
        return b""

    def _ping(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
        r.end()
        return b""

    def _queue_push(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
        key, value = r.str(), r.bytes()
        r.end()
        self._check_size(key, value)
        self._state.queue_push(key, value)
        self._notify(key)
        return b""

    def _queue_len(self, conn: Conn, tag: int, r: P.Reader) -> bytes:
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

    def _forget(self, w: Waiter) -> None:
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

    def _resolve(self, w: Waiter, status: P.Status, payload: bytes) -> None:
        conn = self._settle(w)
        if conn is not None:
            self._answer(conn, w.tag, status, payload)
            self._dirty[conn] = None

    def _settle(self, w: Waiter) -> Conn | None:
        """``w`` is answered: its connection, if still open, for the answer."""
        w.done = True
        self._live_waiters -= 1
        self._dead_in_heap += 1
        conn = w.conn
        conn.waiters.discard(w)
        return None if conn.closed else conn

    def _drop_waiters(self, conn: Conn) -> None:
        """Forget ``conn``'s blocked requests unanswered (it closed, or its client gave up on them)."""
        for w in conn.waiters:
            self._forget(w)
            w.done = True
            w.keys = []
            self._live_waiters -= 1
            self._dead_in_heap += 1
        conn.waiters.clear()

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

    # --- answers -------------------------------------------------------------------

    def _answer(self, conn: Conn, tag: int, status: P.Status, payload: bytes = b"") -> None:
        out = conn.out
        out += P.ANSWER_HEAD.pack(len(payload) + 5, tag, status)
        out += payload

    def _fail(self, conn: Conn, message: str) -> None:
        """Send a fatal error and close once it is written."""
        log.debug("%r: closing %s: %s", self, conn.peer, message)
        self._answer(conn, P.CONNECTION_TAG, P.Status.FATAL, P.pack_bytes(message.encode()))
        conn.phase = CLOSING
        self._dirty[conn] = None
