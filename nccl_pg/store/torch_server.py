"""The TCPStore server's torch.distributed clients: torch's own TCPStore
client, served on the same port and the same data as ours, so that torch
code (``init_process_group("gloo")``, torch's ``TORCHELASTIC_USE_AGENT_STORE``)
runs under ``nccl-pg run`` as under torchrun.

torch's protocol (torch_wire.py) has no authentication: the server speaks it
only when told to (``torch_clients``: "loopback", to connections from this
machine's loopback addresses; "any"; None, the default: never). A
connection is torch's when its first byte is torch's VALIDATE query (ours
starts with the letter N). Semantics are those of torch's libuv server:
a missing key's GET is b"", DELETE_KEY removes the value only, CHECK and WAIT
count a non-empty queue as the key's presence, WAIT and BARRIER have no
deadline at the server (the client cancels). Limits: keys of at most 8 KiB
and 128 Ki keys per request, as torch's; values up to the server's
``max_value_size``; a request (and a multi_get or list_keys answer) of at most a
frame; unread answers past ``OUT_LIMIT`` stop the reading of requests, as for
ours. What breaks them, or the protocol, closes the connection (as torch's
server does).
"""

from __future__ import annotations

import ipaddress
import logging
import math

from ..errors import DistStoreError
from . import protocol as P
from . import torch_wire as W
from .tcp_server_requests import ServerRequests
from .tcp_server_sockets import IN, OUT, OUT_LIMIT, Conn, Waiter

log = logging.getLogger("nccl_pg.store.tcp_server")

TORCH = 4  # a connection's phase once torch's client validated (after tcp_server_sockets' four)
TORCH_CLIENTS = ("loopback", "any")
_RECV_SIZE = 256 * 1024
_FOREVER = 1e9  # seconds: torch's waits have no deadline at the server
_BARRIER = 250  # a waiter's op: a torch BARRIER, parked under _barrier_key(key)
_REFUSAL_LOG_PERIOD = 60.0
_VALIDATE_SIZE = 1 + W.U32.size
_STOP = bytes((W.STOP_WAITING,))
_CANCELED = bytes((W.WAIT_CANCELED,))


def _barrier_key(key: str) -> str:
    return f"\x00torch-barrier\x00{key}"


def loopback_peer(conn: Conn) -> bool:
    try:
        addr = ipaddress.ip_address(conn.sock.getpeername()[0].split("%")[0])
    except (OSError, ValueError):
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool((mapped or addr).is_loopback)


class TorchRequests(ServerRequests):
    """torch's requests over the store's data (see the module's doc); the
    connections' I/O is ServerIO's, which hands torch's connections here."""

    def __init__(self, max_value_size: int, torch_clients: str | None) -> None:
        super().__init__(max_value_size)
        if torch_clients not in (None, *TORCH_CLIENTS):
            raise ValueError(f"torch_clients must be None, 'loopback' or 'any', got {torch_clients!r}")
        self.torch_clients = torch_clients
        self._refusals_logged_at = -math.inf

    # ServerIO's (the connections' I/O, above this class)
    def _close(self, conn: Conn) -> None:
        raise NotImplementedError

    def _set_events(self, conn: Conn, events: int) -> None:
        raise NotImplementedError

    # --- connections ----------------------------------------------------------------------

    def _torch_hello(self, conn: Conn) -> None:
        """A new connection whose first byte is torch's VALIDATE."""
        if self.torch_clients is None or (self.torch_clients == "loopback" and not loopback_peer(conn)):
            self._refuse(conn)
            return
        inbuf = conn.inbuf
        if len(inbuf) < _VALIDATE_SIZE:
            return
        if W.U32.unpack_from(inbuf, 1)[0] != W.VALIDATION_MAGIC:
            log.debug("%r: closing %s: not torch's validation number", self, conn.peer)
            self._close(conn)
            return
        del inbuf[:_VALIDATE_SIZE]
        conn.phase = TORCH
        conn.last_active = self._now
        self._torch_serve(conn)

    def _refuse(self, conn: Conn) -> None:
        if self._now - self._refusals_logged_at >= _REFUSAL_LOG_PERIOD:
            self._refusals_logged_at = self._now
            why = ("it serves torch's unauthenticated protocol to loopback connections only"
                   if self.torch_clients else "it does not serve torch's unauthenticated protocol")
            log.warning("%r: refused a torch.distributed client from %s: %s (nccl-pg run --torch-clients; "
                        "docs/SECURITY.md)", self, conn.peer, why)
        self._close(conn)

    def _torch_readable(self, conn: Conn) -> None:
        if len(conn.out) > OUT_LIMIT:  # back-pressure: read nothing until the client reads its answers
            self._set_events(conn, OUT)
            return
        chunk = self._receive(conn, _RECV_SIZE)
        if chunk is None:
            return
        conn.last_active = self._now
        conn.inbuf += chunk
        self._torch_serve(conn)

    def _receive(self, conn: Conn, n: int) -> bytes | None:
        """Up to ``n`` bytes from ``conn``; None when there are none yet, or it ended (then it is closed)."""
        try:
            chunk = conn.sock.recv(n)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return None
        return chunk

    def _torch_flushed(self, conn: Conn) -> None:
        """Answers went out: go on with requests held back, and read again."""
        if conn.inbuf and len(conn.out) <= OUT_LIMIT:
            self._torch_serve(conn)
        if not conn.closed:
            self._set_events(conn, IN | OUT if conn.out else IN)

    def _torch_serve(self, conn: Conn) -> None:
        """Handle the whole requests in the connection's input."""
        inbuf = conn.inbuf
        pos, end = 0, len(inbuf)
        try:
            while pos < end and len(conn.out) <= OUT_LIMIT:
                c = W.Cursor(inbuf, pos + 1, end, self.max_value_size)
                try:
                    self._torch_request(conn, inbuf[pos], c)
                except W.Incomplete:
                    break
                pos = c.pos
                if conn.closed:
                    return
        except (ValueError, DistStoreError) as exc:  # torch's server closes the connection on these too
            log.debug("%r: closing torch client %s: %s", self, conn.peer, exc)
            self._close(conn)
            return
        del inbuf[:pos]
        if len(inbuf) > self._max_frame:
            log.debug("%r: closing torch client %s: a request over %d bytes", self, conn.peer, self._max_frame)
            self._close(conn)
        elif conn.out:
            self._dirty[conn] = None

    # --- requests ---------------------------------------------------------------------------

    def _torch_request(self, conn: Conn, query: int, c: W.Cursor) -> None:  # noqa: C901, PLR0912 (a switch)
        """Parse one request whole (Incomplete leaves nothing done), then apply it."""
        state, out, Q = self._state, conn.out, W.Query
        if query == Q.SET:
            key, value = c.key(), c.value()
            state.data[key] = value
            self._notify(key)
        elif query == Q.GET:
            out += W.text(state.data.get(c.key(), b""))
        elif query == Q.ADD:
            key, amount = c.key(), c.i64()
            out += W.I64.pack(state.add(key, amount))
            self._notify(key)
        elif query == Q.CHECK:
            out += W.U8.pack(W.NOT_READY if state.missing(c.keys()) else W.READY)
        elif query == Q.WAIT:
            if self._blocking(conn, 0, P.Op.WAIT, c.keys(), _FOREVER) is not None:
                out += _STOP
        elif query == Q.CANCEL_WAIT:
            self._drop_waiters(conn)
            out += _CANCELED
        elif query == Q.COMPARE_SET:
            key, expected, desired = c.key(), c.value(), c.value()
            out += W.text(state.compare_set(key, expected, desired))
            self._notify(key)
        elif query == Q.PING:
            out += W.U32.pack(c.u32())
        elif query in (Q.APPEND, Q.QUEUE_PUSH):
            key, value = c.key(), c.value()
            if query == Q.APPEND:
                self._check_size(key, state.data.get(key, b"") + value)
                state.append(key, value)
            else:
                state.queue_push(key, value)
            self._notify(key)
        elif query == Q.MULTI_GET:
            values = [state.data.get(k, b"") for k in c.keys()]
            self._check_answer(sum(len(v) + 8 for v in values), "multi_get")
            out += b"".join(W.text(v) for v in values)
        elif query == Q.MULTI_SET:
            n = c.i64()
            if not 0 <= n <= W.MAX_KEYS:
                raise ValueError(f"multi_set of {n} keys")
            pairs = [(c.key(), c.value()) for _ in range(n)]
            for key, value in pairs:
                state.data[key] = value
                self._notify(key)
        elif query == Q.DELETE_KEY:
            out += W.I64.pack(int(state.data.pop(c.key(), None) is not None))
        elif query == Q.GETNUMKEYS:
            out += W.I64.pack(state.num_keys())
        elif query == Q.QUEUE_POP:
            key = c.key()
            n = state.queue_len(key)
            out += W.I64.pack(n)
            if n:
                out += W.text(state.queue_pop(key) or b"")
        elif query == Q.QUEUE_LEN:
            out += W.I64.pack(state.queue_len(c.key()))
        elif query == Q.LIST_KEYS:
            keys = [k.encode() for k in state.list_keys()]
            self._check_answer(sum(len(k) + 8 for k in keys), "list_keys")
            out += W.I64.pack(len(keys)) + b"".join(W.text(k) for k in keys)
        elif query == Q.BARRIER:
            self._barrier(conn, c.key(), c.i64())
        else:
            raise ValueError(f"unexpected query {query}")

    def _check_answer(self, size: int, what: str) -> None:
        if size > self._max_frame:
            raise DistStoreError(f"a {what} answer of {size} bytes, over the frame limit of {self._max_frame}")

    def _barrier(self, conn: Conn, key: str, world_size: int) -> None:
        """torch's BARRIER: count the arrival under ``key``; the last one releases them all."""
        count = self._state.add(key, 1)
        self._notify(key)
        parked = _barrier_key(key)
        if count < world_size:
            self._blocking(conn, 0, _BARRIER, [parked], _FOREVER)
            return
        conn.out += _STOP
        for w in self._waiting.pop(parked, {}):
            w.pending -= 1
            self._resolve(w, P.Status.OK, b"")

    def _resolve(self, w: Waiter, status: P.Status, payload: bytes) -> None:
        if w.conn.phase != TORCH:
            super()._resolve(w, status, payload)
            return
        conn = self._settle(w)
        if conn is not None:  # torch's waits end only when their keys are there
            conn.out += _STOP
            self._dirty[conn] = None
