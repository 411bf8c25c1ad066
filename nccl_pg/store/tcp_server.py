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

The server is one class in three parts, bottom up: its requests and waiters
(tcp_server_requests.py, with ``MAX_WAITERS``), its connections' I/O
(tcp_server_io.py, with ``OUT_LIMIT``), and here its settings, public face
and loop; tcp_server_sockets.py holds what it keeps per connection and the
sockets.
"""

from __future__ import annotations

import logging
import resource
import socket
import threading
import time

from .. import env
from ..timeouts import to_seconds
from . import protocol as P
from .tcp_server_io import ServerIO
from .tcp_server_sockets import IN, OUT, listen, raise_fd_limit

log = logging.getLogger(__name__)

_SWEEP_PERIOD = 1.0  # seconds between checks of handshake and idle deadlines
# Seconds a new connection has to prove the secret: a real client does it in one round trip, so 30 s only
# outlasts a loaded machine and keeps silent port scanners from holding descriptors.
HANDSHAKE_TIMEOUT = 30.0
_STOP_TIMEOUT = 5.0  # seconds stop() waits for the server thread to close everything: it only closes sockets


class TCPStoreServer(ServerIO):
    """The store's server. Runs in a background thread (``start()``), e.g.
    inside rank 0 or the launcher, or in the foreground (``serve_forever()``).

    ``idle_timeout`` (default ``NCCL_PG_STORE_IDLE_TIMEOUT``, 600 s; 0: never)
    applies to authenticated connections with no blocked request. Starting a
    server raises this process's soft file-descriptor limit to the hard one.
    ``torch_clients`` ("loopback", "any"; default None: none) also serves
    torch.distributed's own TCPStore clients, unauthenticated
    (torch_server.py, docs/SECURITY.md).
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
        torch_clients: str | None = None,
    ) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if secret is None:
            secret = env.STORE_SECRET.get()
        key = secret.encode() if isinstance(secret, str) else secret
        if max_value_size is None:
            max_value_size = env.STORE_MAX_VALUE_SIZE.get()
        if not isinstance(max_value_size, int) or max_value_size < 1:
            raise ValueError(f"max_value_size must be a positive int, got {max_value_size!r}")
        idle = env.STORE_IDLE_TIMEOUT.get() if idle_timeout is None else \
            to_seconds(idle_timeout, "idle_timeout", zero=True)
        handshake = to_seconds(handshake_timeout, "handshake_timeout")
        self.fd_limit = raise_fd_limit()
        super().__init__(listen(host, port, backlog, listen_fd), key, max_value_size, idle, handshake, torch_clients)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
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
        poller.register(listen_fd, IN)
        poller.register(wake_fd, IN)
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
                    if mask & OUT:
                        self._flush(conn)
                    if mask & ~OUT and not conn.closed:
                        self._on_readable(conn)
                if self._deadlines and self._deadlines[0][0] <= now:
                    self._expire_waiters(now)
                if self._accept_paused_until and now >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    poller.register(listen_fd, IN)
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

