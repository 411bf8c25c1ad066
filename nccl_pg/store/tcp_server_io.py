"""The TCPStore server's connection I/O: accepting (paused with a backoff when
out of descriptors), the handshake that proves the secret, reading frames
(SET, ADD, and GET and one-key WAIT of a present key decoded inline, the rest through the
request handlers of tcp_server_requests.py), back-pressure, the handshake and
idle sweep, sending and closing. The middle part of TCPStoreServer; its loop
is tcp_server.py."""

from __future__ import annotations

import errno
import hmac
import logging
import math
import os
import resource
import socket

from . import protocol as P
from .tcp_server_sockets import AUTH, CLOSING, HELLO, IN, OUT, OUT_LIMIT, READY, Conn, Poller
from .torch_server import TORCH, TorchRequests

log = logging.getLogger("nccl_pg.store.tcp_server")

_RECV_SIZE = 256 * 1024
_FD_LOG_PERIOD = 60.0  # seconds between warnings while out of descriptors: one a minute, not one per refusal
# Pause before accepting again when out of descriptors: short enough to serve a freed one soon, doubled per
# refusal up to a cap so that a lasting shortage costs one wake-up a second.
_ACCEPT_BACKOFF_FIRST = 0.05
_ACCEPT_BACKOFF_MAX = 1.0
_FD_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_PROOF_FRAME = 4 + P.PROOF_SIZE
_SET = int(P.Op.SET)
_ADD = int(P.Op.ADD)
_GET = int(P.Op.GET)
_WAIT = int(P.Op.WAIT)


class ServerIO(TorchRequests):
    """The connections of the server (see TCPStoreServer): ``listener`` is its
    listening socket, ``secret`` the one clients must prove (None or empty: no
    authentication), ``torch_clients`` whom torch's own clients are served to
    (torch_server.py)."""

    def __init__(self, listener: socket.socket, secret: bytes | None, max_value_size: int, idle_timeout: float,
                 handshake_timeout: float, torch_clients: str | None = None) -> None:
        super().__init__(max_value_size, torch_clients)
        self._secret = secret
        self.idle_timeout = idle_timeout
        self._handshake_timeout = handshake_timeout
        self._listener = listener
        self._conns: dict[int, Conn] = {}
        self._poller = Poller()
        # One receive buffer for every connection (the loop is single-threaded):
        # recv(n) would allocate, and for n this large mmap/munmap, per read.
        self._rbuf = bytearray(_RECV_SIZE)
        self._rview = memoryview(self._rbuf)
        self._accept_paused_until = 0.0
        self._accept_backoff = _ACCEPT_BACKOFF_FIRST
        self._fd_refusals = 0
        self._fd_logged_at = -math.inf

    # --- accepting and reading --------------------------------------------------

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
            conn = Conn(sock, f"{addr[0]}:{addr[1]}", self._now + self._handshake_timeout)
            self._conns[conn.fd] = conn
            self._poller.register(conn.fd, IN)

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

    def _on_readable(self, conn: Conn) -> None:
        if conn.phase != READY:
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
            if pos < n and conn.phase == READY:
                inbuf += self._rview[pos:n]
        if conn.out:
            self._flush(conn)

    def _process_inbuf(self, conn: Conn) -> None:
        inbuf = conn.inbuf
        view = memoryview(inbuf)
        try:
            pos = self._process(conn, inbuf, view, 0, len(inbuf))
        finally:
            view.release()
        del inbuf[:pos]

    def _process(self, conn: Conn, buf: bytearray, view: memoryview, pos: int, end: int) -> int:
        """Handle the whole requests in ``buf[pos:end]``; returns where the
        unhandled rest starts (a partial frame, or input paused by back-pressure)."""
        unpack_u32, unpack_i64, unpack_f64 = P.U32.unpack_from, P.I64.unpack_from, P.F64.unpack_from
        pack_answer, pack_i64, pack_u32 = P.ANSWER_HEAD.pack, P.I64.pack, P.U32.pack
        data, waiting, counts, max_value = self._state.data, self._waiting, self._counts, self.max_value_size
        queues = self._state.queues
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
                    total: int | None = int(data.get(key, 0)) + unpack_i64(buf, stop - 8)[0]
                except (UnicodeDecodeError, ValueError):
                    total = None
                if total is None or not -(2**63) <= total < 2**63:  # the generic path words the error
                    self._request(conn, op, tag, bytes(view[pos + 9:stop]))
                    if conn.phase != READY:  # a FATAL answer: nothing after it is handled (issue 30)
                        return end
                else:
                    data[key] = b"%d" % total
                    out += pack_answer(13, tag, 0)
                    out += pack_i64(total)
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
                    if conn.phase != READY:
                        return end
                else:
                    out += pack_answer(len(value) + 9, tag, 0)
                    out += pack_u32(len(value))
                    out += value
            elif (op == _WAIT and n >= 21 and unpack_u32(buf, pos + 9)[0] == 1
                  and unpack_u32(buf, pos + 13)[0] == n - 21
                  and 0 < unpack_f64(buf, stop - 8)[0] < math.inf):  # one key, there already: answered inline
                try:
                    present = (key := str(view[pos + 17:stop - 8], "utf-8")) in data or key in queues
                except UnicodeDecodeError:
                    present = False
                if present:
                    out += pack_answer(5, tag, 0)
                else:  # park a waiter, or word the error
                    self._request(conn, op, tag, bytes(view[pos + 9:stop]))
                    if conn.phase != READY:
                        return end
            else:
                self._request(conn, op, tag, bytes(view[pos + 9:stop]))
                if conn.phase != READY:
                    return end
            pos = stop
            if len(out) > OUT_LIMIT:  # back-pressure: read no more until the client reads its answers
                conn.paused = True
                self._set_events(conn, OUT)
                break
        return pos

    # --- handshake ------------------------------------------------------------

    def _read_handshake(self, conn: Conn) -> None:
        """Read only what the handshake's next message may be: nothing larger
        is buffered for a peer that has not proven it knows the secret."""
        if conn.phase == TORCH:
            self._torch_readable(conn)
            return
        chunk = self._receive(conn, (P.HELLO_SIZE if conn.phase == HELLO else _PROOF_FRAME) - len(conn.inbuf))
        if chunk is None:
            return
        inbuf = conn.inbuf
        inbuf += chunk
        if conn.phase == HELLO:
            if inbuf[0] == 0:  # torch's VALIDATE query (ours starts with the magic)
                self._torch_hello(conn)
            elif not P.MAGIC.startswith(bytes(inbuf[:len(P.MAGIC)])):
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
            if conn.phase == READY and inbuf:
                self._process_inbuf(conn)
        self._flush(conn)

    def _hello(self, conn: Conn, hello: bytes) -> None:
        conn.client_nonce = hello[len(P.MAGIC):]
        conn.server_nonce = os.urandom(P.NONCE_SIZE)
        if self._secret:
            flags = P.FLAG_AUTH
            server_proof = P.proof(self._secret, b"server", conn.client_nonce, conn.server_nonce)
        else:
            flags, server_proof = 0, bytes(P.PROOF_SIZE)
        conn.out += P.frame(P.SERVER_HELLO.pack(conn.server_nonce, flags, self.max_value_size, self.idle_timeout,
                                                server_proof))
        conn.phase = AUTH

    def _auth(self, conn: Conn, client_proof: bytes) -> None:
        if self._secret:
            expected = P.proof(self._secret, b"client", conn.server_nonce, conn.client_nonce)
            if not hmac.compare_digest(client_proof, expected):
                why = "no secret given" if not client_proof else "wrong secret"
                self._fail(conn, f"authentication failed ({why}); set NCCL_PG_STORE_SECRET to the server's secret")
                return
        conn.phase = READY
        conn.last_active = self._now
        conn.out += P.answer(P.CONNECTION_TAG, P.Status.OK)

    def _sweep(self, now: float) -> None:
        idle = self.idle_timeout
        for conn in list(self._conns.values()):
            if conn.phase < READY:
                if conn.deadline < now:
                    log.debug("%r: dropping %s: no handshake within %.1f s", self, conn.peer,
                              self._handshake_timeout)
                    self._close(conn)
            elif (idle and conn.phase == READY and not conn.waiters and not conn.out
                  and now - conn.last_active > idle):
                conn.out += P.answer(P.CONNECTION_TAG, P.Status.GOAWAY,
                                     P.pack_bytes(f"idle for more than {idle:g} s".encode()))
                conn.phase = CLOSING
                self._flush(conn)

    # --- output and teardown -----------------------------------------------

    def _set_events(self, conn: Conn, events: int) -> None:
        if events != conn.events:
            conn.events = events
            self._poller.modify(conn.fd, events)

    def _flush(self, conn: Conn) -> None:
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
        if conn.phase != READY:
            if conn.phase == CLOSING and not out:
                self._close(conn)
            elif conn.phase == TORCH:
                self._torch_flushed(conn)
            else:
                self._set_events(conn, OUT if conn.phase == CLOSING else (IN | OUT if out else IN))
            return
        if conn.paused and len(out) <= OUT_LIMIT:  # the client read enough: go on with its requests
            conn.paused = False
            self._process_inbuf(conn)
            if out:
                self._dirty[conn] = None
        events = OUT if conn.paused else (IN | OUT if out else IN)
        if events != conn.events:
            conn.events = events
            self._poller.modify(conn.fd, events)

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._drop_waiters(conn)  # now: a dead client's keys may never be set
        conn.inbuf = bytearray()
        conn.out = bytearray()
        self._conns.pop(conn.fd, None)
        self._dirty.pop(conn, None)
        try:
            self._poller.unregister(conn.fd)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
