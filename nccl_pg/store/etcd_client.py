"""A small client of etcd's v3 API through its gRPC gateway (JSON over HTTP)
with the standard library; docs/STORES.md says why no client library.

What it adds to plain HTTP is what a store needs:

- **Deadlines**: every request and every watch ends by the caller's deadline.
- **Failover**: the endpoints are the cluster's members. Requests go to one
  member, the same until it fails, then to the next: a request that could
  not be sent (refused, unreachable), that its member lost in flight, or
  that the member turned down as unavailable ("no leader") is sent to the
  next one. So every request must be safe to send twice: the store makes
  its conditional writes so (etcd_store.py, "markers").
- **Watches**: a watch is a streamed HTTP/1.0 answer, one JSON message a
  line, ended by closing the connection; one thread waits on several with
  poll(). Closing the connection cancels the watch at the member.
- **Fork safety**: a forked child never uses its parent's connections.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..errors import DistNetworkError, DistStoreError
from .base import Backoff, SharedClient, fork_count

# One connection attempt to one member waits at most this long, so that a member whose machine is gone
# (no refusal, silence) leaves time within the deadline to try the others.
_CONNECT_ATTEMPT = 3.0
# A member that has not begun to answer a request after this long is silent (hung, or its machine frozen):
# the request goes to the next member. etcd itself answers every request within its request timeout
# (5 s + 2 election timeouts: 7 s by default), with an error if need be.
SILENT_AFTER = 20.0
# A parked watch carries no traffic; TCP keepalive (the kernel's probes, no request to etcd) notices a
# member whose machine vanished (powered off, cut off) within about 20 + 2 * 5 s, and the wait moves on.
_KEEPALIVE = (("TCP_KEEPIDLE", 20), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2))
_UNAVAILABLE = 14  # the gRPC status code (the gateway's "code") of a member that cannot serve now
_TOO_LARGE = ("request is too large", "larger than max")
_HEADERS = {"Content-Type": "application/json"}
_READ_SIZE = 64 * 1024

Json = dict[str, Any]
T = TypeVar("T")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def parse_endpoints(spec: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` (or a list of ``host:port``; ``http://`` may
    precede each, IPv6 hosts in brackets) as (host, port) pairs."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"etcd endpoints: expected 'host:port[,host:port...]', got {spec!r}")
        text = item.strip()
        parts = urlsplit(text if "//" in text else f"//{text}")
        if parts.scheme not in ("", "http"):
            raise ValueError(f"etcd endpoint {text!r}: only http:// is supported (no TLS)")
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or parts.path not in ("", "/"):
            raise ValueError(f"etcd endpoint {text!r}: expected host:port")
        out.append((parts.hostname, port))
    return out


@dataclass
class Event:
    """A change seen by a watch: ``put`` (else a delete), the etcd key, the value put."""

    put: bool
    key: bytes
    value: bytes


class StreamLost(Exception):
    """A watch ended before the caller was done (its member was lost, or etcd
    cancelled it, e.g. for compaction): read the state again and watch anew."""


class _Timeout(Exception):
    """The member took the request but did not answer by the deadline."""


class _TryNext(Exception):
    """This member cannot serve the request now; ``refused``: the connection was refused."""

    def __init__(self, detail: str, refused: bool = False) -> None:
        super().__init__(detail)
        self.detail, self.refused = detail, refused


class WatchStream:
    """One watch: its socket and what has been read of its messages."""

    def __init__(self, sock: socket.socket, buf: bytes) -> None:
        self.sock = sock
        self.buf = bytearray(buf)

    def fileno(self) -> int:
        return self.sock.fileno()

    def fill(self) -> None:
        """Read what has arrived (after poll() said there is something)."""
        try:
            chunk = self.sock.recv(_READ_SIZE)
        except OSError as exc:
            raise StreamLost(f"connection lost: {exc}") from None
        if not chunk:
            raise StreamLost("the member closed the watch")
        self.buf += chunk

    def events(self) -> list[Event]:
        """The events of the complete messages read so far."""
        out: list[Event] = []
        while True:
            end = self.buf.find(b"\n")
            if end < 0:
                return out
            line = bytes(self.buf[:end])
            del self.buf[:end + 1]
            if line.strip():
                out.extend(_events(_message(line)))


def _message(line: bytes) -> Json:
    try:
        message = json.loads(line)
    except ValueError:
        raise StreamLost(f"malformed watch message {line[:80]!r}") from None
    if "error" in message:
        raise StreamLost(f"watch failed: {message['error']}")
    result: Json = message.get("result", {})
    if result.get("canceled"):
        raise StreamLost(f"watch cancelled by etcd: {result.get('cancel_reason') or result}")
    return result


def _events(result: Json) -> list[Event]:
    return [Event(e.get("type", "PUT") == "PUT", unb64(e["kv"]["key"]), unb64(e["kv"].get("value", "")))
            for e in result.get("events", ())]


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection that the member closed (or that has
    unexpected bytes waiting): never send on it."""
    sock = conn.sock
    if sock is None:
        return True
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
        return True  # EOF, or bytes nobody asked for
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


class EtcdClient(SharedClient):
    """The connections of an EtcdStore and its clones to the members of one cluster."""

    def __init__(self, endpoints: str | Sequence[str]) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.names = [f"{h}:{p}" if ":" not in h else f"[{h}]:{p}" for h, p in self.endpoints]
        # Clients start at different members, so that a job's ranks spread over the cluster.
        self.current = random.randrange(len(self.endpoints))
        self.lock = threading.Lock()
        self.idle: list[http.client.HTTPConnection] = []  # keep-alive connections to the current member
        self.streams: set[WatchStream] = set()
        self.forks = fork_count()
        self.ident = os.urandom(6).hex()  # names this client's writers in the store's markers
        self.closed = False
        self.ever_answered = False
        self.requests = 0  # requests sent (watches included), for tests and benchmarks
        self.users = 1

    @property
    def address(self) -> str:
        return ",".join(self.names)

    # --- members and connections ------------------------------------------------

    def _check_fork(self) -> None:
        """In a forked child: the connections are the parent's; close only our copies of them."""
        if self.forks == fork_count():
            return
        self.forks = fork_count()
        self.lock = threading.Lock()
        self.ident = os.urandom(6).hex()  # the parent's threads are not ours
        for conn in self.idle:
            if conn.sock is not None:
                conn.sock.close()  # never shutdown(): that would cut the parent off
        for stream in self.streams:
            stream.sock.close()
        self.idle, self.streams = [], set()

    def _usable(self, what: str) -> None:
        self._check_fork()
        if self.closed:
            raise DistStoreError(f"EtcdStore({self.address}) is closed (during {what})")

    def _move_on(self, index: int) -> None:
        """The member ``index`` failed: use the next one."""
        with self.lock:
            if self.current != index:
                return
            self.current = (index + 1) % len(self.endpoints)
            stale, self.idle = self.idle, []
        for conn in stale:
            conn.close()

    def _connect(self, index: int, deadline: float) -> socket.socket:
        host, port = self.endpoints[index]
        try:
            sock = socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(),
                                                                           _CONNECT_ATTEMPT), 0.001))
        except ConnectionRefusedError as exc:
            raise _TryNext(f"connection refused ({exc})", refused=True) from None
        except OSError as exc:
            raise _TryNext(f"cannot connect: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _take(self, index: int, deadline: float) -> http.client.HTTPConnection:
        with self.lock:
            pooled = self.idle if index == self.current else []
            while pooled:
                conn = pooled.pop()
                if not _dropped(conn):
                    return conn
                conn.close()
        host, port = self.endpoints[index]
        conn = http.client.HTTPConnection(host, port)
        conn.sock = self._connect(index, deadline)
        return conn

    def _give_back(self, index: int, conn: http.client.HTTPConnection) -> None:
        with self.lock:
            if index == self.current and not self.closed:
                self.idle.append(conn)
                return
        conn.close()

    # --- requests ---------------------------------------------------------------

    def request(self, path: str, payload: Json, deadline: float, what: str) -> Json:
        """POST ``payload`` to ``/v3/<path>`` and return the answer; DistNetworkError
        when no member could be reached in time, DistStoreError when one did not
        answer in time or refused, ValueError when etcd found the request too large."""
        body = json.dumps(payload).encode()
        return self._with_failover(lambda i: self._attempt(i, f"/v3/{path}", body, deadline, what), deadline, what)

    def version(self, deadline: float) -> Json:
        """The answer of a member's /version (the first that answers)."""
        return self._with_failover(lambda i: self._attempt(i, "/version", None, deadline, "connect"),
                                   deadline, "connect")

    def _with_failover(self, attempt: Callable[[int], T], deadline: float, what: str) -> T:
        start = time.monotonic()
        backoff = Backoff(deadline, first=0.01, cap=1.0)
        while True:
            failures: dict[str, _TryNext] = {}
            for _ in range(len(self.endpoints)):
                self._usable(what)
                if time.monotonic() >= deadline:
                    break
                index = self.current
                try:
                    return attempt(index)
                except _Timeout as exc:
                    raise DistStoreError(f"timeout: etcd member {exc} did not answer {what} within "
                                         f"{time.monotonic() - start:.2f} s") from None
                except _TryNext as exc:
                    failures[self.names[index]] = exc
                    self._move_on(index)
            detail = "; ".join(f"{name}: {exc.detail}" for name, exc in failures.items()) or "no time left"
            if (self.ever_answered and len(failures) == len(self.endpoints)
                    and all(f.refused for f in failures.values())):
                raise DistNetworkError(f"etcd cluster {self.address} is gone: every member refused the connection "
                                       f"during {what} ({detail})")
            if not backoff.sleep():
                raise DistNetworkError(f"timeout: no etcd member of {self.address} could be reached for {what} "
                                       f"within {time.monotonic() - start:.2f} s ({detail})")

    def _attempt(self, index: int, path: str, body: bytes | None, deadline: float, what: str) -> Json:
        name = self.names[index]
        conn = self._take(index, deadline)
        silent = False
        try:
            assert conn.sock is not None
            left = max(deadline - time.monotonic(), 0.001)
            silent = left > SILENT_AFTER
            conn.sock.settimeout(min(left, SILENT_AFTER))
            with self.lock:
                self.requests += 1
            if body is None:
                conn.request("GET", path)
            else:
                conn.request("POST", path, body, _HEADERS)
            resp = conn.getresponse()
            silent = False  # it answers: the rest of the answer may take until the deadline
            conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            data = resp.read()
        except TimeoutError:
            conn.close()
            if silent:
                raise _TryNext(f"silent for {SILENT_AFTER:g} s") from None
            raise _Timeout(name) from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _TryNext(f"lost: {exc!r}") from None
        if resp.will_close:
            conn.close()
        else:
            self._give_back(index, conn)
        self.ever_answered = True
        try:
            answer: Json = json.loads(data)
        except ValueError:
            raise DistStoreError(f"{name} did not answer {what} like an etcd member (HTTP {resp.status}: "
                                 f"{data[:100]!r})") from None
        if resp.status == 200:
            return answer
        message = str(answer.get("message") or answer.get("error") or answer)
        if any(m in message for m in _TOO_LARGE):
            raise ValueError(f"{what} is too large for etcd ({message}): its request limit is "
                             f"--max-request-bytes, 1.5 MiB by default")
        if answer.get("code") == _UNAVAILABLE:
            raise _TryNext(message)
        raise DistStoreError(f"etcd member {name} refused {what}: {message}")

    def local_address(self, deadline: float) -> str:
        """This host's address on a connection to the cluster (no request sent)."""

        def local(index: int) -> str:
            conn = self._take(index, deadline)
            assert conn.sock is not None
            address = str(conn.sock.getsockname()[0])
            self._give_back(index, conn)
            return address

        return self._with_failover(local, deadline, "local_address")

    # --- watches ------------------------------------------------------------------

    def watch(self, key: bytes, range_end: bytes, start_revision: int, deadline: float, what: str) -> WatchStream:
        """Watch the keys in [key, range_end) from ``start_revision`` on (so
        that nothing since a read at ``start_revision - 1`` is missed)."""
        body = json.dumps({"create_request": {"key": b64(key), "range_end": b64(range_end),
                                              "start_revision": start_revision}}).encode()
        return self._with_failover(lambda i: self._open_watch(i, body, deadline, what), deadline, what)

    def _open_watch(self, index: int, body: bytes, deadline: float, what: str) -> WatchStream:
        host, port = self.endpoints[index]
        sock = self._connect(index, deadline)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in _KEEPALIVE:
            if hasattr(socket, option):  # Linux; elsewhere the system's keepalive times apply
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        left = max(deadline - time.monotonic(), 0.001)
        try:
            sock.settimeout(min(left, SILENT_AFTER))
            with self.lock:
                self.requests += 1
            sock.sendall(b"POST /v3/watch HTTP/1.0\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port, len(body), body))
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = sock.recv(_READ_SIZE)
                if not chunk:
                    raise ConnectionResetError("closed before answering")
                buf += chunk
        except TimeoutError:
            sock.close()
            if left > SILENT_AFTER:
                raise _TryNext(f"silent for {SILENT_AFTER:g} s") from None
            raise _Timeout(self.names[index]) from None
        except OSError as exc:
            sock.close()
            raise _TryNext(f"lost: {exc!r}") from None
        head, _, rest = buf.partition(b"\r\n\r\n")
        if head.split(b" ", 2)[1:2] != [b"200"]:
            sock.close()
            raise _TryNext(f"watch refused: {head.splitlines()[0]!r} {rest[:200]!r}")
        self.ever_answered = True
        stream = WatchStream(sock, rest)
        with self.lock:
            if self.closed:
                sock.close()
                raise DistStoreError(f"EtcdStore({self.address}) was closed during {what}")
            self.streams.add(stream)
        return stream

    def wait_events(self, streams: Sequence[WatchStream], deadline: float) -> list[Event]:
        """The events that arrive on ``streams`` by ``deadline`` (none: the
        deadline passed); StreamLost when one of them ended."""
        while True:
            events = [e for s in streams for e in s.events()]
            if events:
                return events
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            poller = select.poll()
            for s in streams:
                poller.register(s.fileno(), select.POLLIN)
            ready = {fd for fd, _ in poller.poll(max(int(left * 1000), 1))}
            if self.closed:
                raise DistStoreError(f"EtcdStore({self.address}) was closed during the wait")
            for s in streams:
                if s.fileno() in ready:
                    s.fill()

    def end_watch(self, stream: WatchStream) -> None:
        with self.lock:
            self.streams.discard(stream)
        stream.sock.close()

    def close(self) -> None:
        """Close every connection; wakes the threads waiting on a watch."""
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
            streams = list(self.streams)
        for conn in idle:
            conn.close()
        for stream in streams:
            try:
                stream.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
