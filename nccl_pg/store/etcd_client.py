"""A small client of etcd's v3 API through its gRPC gateway (JSON over HTTP)
with the standard library; docs/STORES.md says why no client library.

What it adds to plain HTTP is what a store needs:

- **Deadlines**: every request and every watch ends by the caller's deadline,
  whatever a member does (etcd_wire.py: each read waits for what is left of
  it; answers and watch lines bounded in size; malformed answers are a
  DistStoreError naming the member).
- **Silent members**: a member that has not answered a request in full
  after half of the time left (at most ``SILENT_AFTER``, 10 s) is left for the
  next one, so that a frozen member costs part of a deadline, never all of
  it, whatever the store's timeout.
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
from .etcd_wire import MAX_LINE, Late, Malformed, check, read_answer, read_head, request_bytes, send

# One connection attempt to one member waits at most this long, so that a member whose machine is gone
# (no refusal, silence) leaves time within the deadline to try the others.
_CONNECT_ATTEMPT = 3.0
# A member that has not answered a request in full after half of the time left, and at most this long, is
# silent (hung, or its machine frozen): the request goes to the next member. etcd itself answers every request
# within its request timeout (5 s + 2 election timeouts: 7 s by default), with an error if need be.
SILENT_AFTER = 10.0
MIN_SILENT = 0.5  # below twice this much time left, a request waits for its member to the end
# Idle keep-alive connections kept per client (more are closed when given back), and how long one may sit idle.
MAX_IDLE = 4
IDLE_CLOSE = 30.0
# A parked watch carries no traffic; TCP keepalive (the kernel's probes, no request to etcd) notices a
# member whose machine vanished (powered off, cut off) within about 20 + 2 * 5 s, and the wait moves on.
_KEEPALIVE = (("TCP_KEEPIDLE", 20), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2))
_UNAVAILABLE = 14  # the gRPC status code (the gateway's "code") of a member that cannot serve now
_TOO_LARGE = ("request is too large", "larger than max")
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
    """One watch: its socket, its member and what has been read of its messages."""

    def __init__(self, sock: socket.socket, buf: bytes, member: str = "") -> None:
        self.sock = sock
        self.buf = bytearray(buf)
        self.member = member
        self.malformed = False  # it ended on something etcd does not send: leave its member

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
        if len(self.buf) > MAX_LINE and self.buf.find(b"\n") < 0:
            self.malformed = True
            raise StreamLost(f"etcd member {self.member} sent a watch message over {MAX_LINE} bytes")

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
                try:
                    out.extend(_events(_message(line)))
                except Malformed as exc:
                    self.malformed = True
                    raise StreamLost(f"etcd member {self.member} sent a malformed watch message ({exc}): "
                                     f"{line[:80]!r}") from None


def _message(line: bytes) -> Json:
    try:
        message = json.loads(line)
    except ValueError:
        raise Malformed("not JSON") from None
    if not isinstance(message, dict):
        raise Malformed("not an object")
    if "error" in message:
        raise StreamLost(f"watch failed: {message['error']!r:.200}")
    result: Json = check(message.get("result", {}), "result")
    if result.get("canceled"):
        raise StreamLost(f"watch cancelled by etcd: {result.get('cancel_reason') or result}")
    return result


def _events(result: Json) -> list[Event]:
    out = []
    for e in result.get("events", ()):
        if not isinstance(e, dict) or not isinstance(e.get("kv"), dict) or "key" not in e["kv"]:
            raise Malformed(f"an event without a key-value: {e!r:.80}")
        out.append(Event(e.get("type", "PUT") == "PUT", unb64(e["kv"]["key"]), unb64(e["kv"].get("value", ""))))
    return out


def _dropped(sock: socket.socket) -> bool:
    """An idle keep-alive connection that the member closed (or that has
    unexpected bytes waiting): never send on it."""
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
        self.idle: list[tuple[socket.socket, float]] = []  # keep-alive connections to the current member, since
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
        for sock, _ in self.idle:
            sock.close()  # never shutdown(): that would cut the parent off
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
        for sock, _ in stale:
            sock.close()

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

    def _take(self, index: int, deadline: float) -> socket.socket:
        now = time.monotonic()
        with self.lock:
            stale = [s for s, since in self.idle if now - since > IDLE_CLOSE]
            self.idle = [(s, since) for s, since in self.idle if now - since <= IDLE_CLOSE]
            pooled = self.idle if index == self.current else []
            sock = None
            while pooled and sock is None:
                candidate, _ = pooled.pop()
                if _dropped(candidate):
                    stale.append(candidate)
                else:
                    sock = candidate
        for s in stale:
            s.close()
        return sock if sock is not None else self._connect(index, deadline)

    def _give_back(self, index: int, sock: socket.socket) -> None:
        with self.lock:
            if index == self.current and not self.closed and len(self.idle) < MAX_IDLE:
                self.idle.append((sock, time.monotonic()))
                return
        sock.close()

    def idle_connections(self) -> int:
        with self.lock:
            return len(self.idle)

    def _silent_after(self, deadline: float) -> float | None:
        """How long the current member may take to answer in full before the
        request goes to another (None: until the deadline: no other member,
        or too little time left to try one)."""
        left = deadline - time.monotonic()
        if len(self.endpoints) == 1 or left < 2 * MIN_SILENT:
            return None
        return min(SILENT_AFTER, left / 2)

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
        sock = self._take(index, deadline)
        silent = self._silent_after(deadline)
        until = deadline if silent is None else time.monotonic() + silent
        host, port = self.endpoints[index]
        try:
            with self.lock:
                self.requests += 1
            send(sock, request_bytes("GET" if body is None else "POST", path, f"{host}:{port}", body), until)
            resp = read_answer(sock, until)
        except Late:
            sock.close()
            if silent is not None:
                raise _TryNext(f"no whole answer within {silent:.1f} s (silent, or answering too slowly)") from None
            raise _Timeout(name) from None
        except Malformed as exc:
            sock.close()
            raise DistStoreError(f"etcd member {name} answered {what} with {exc}") from None
        except OSError as exc:
            sock.close()
            raise _TryNext(f"lost: {exc!r}") from None
        if resp.close:
            sock.close()
        else:
            self._give_back(index, sock)
        self.ever_answered = True
        try:
            answer = json.loads(resp.body)
            if not isinstance(answer, dict):
                raise Malformed(f"a JSON {type(answer).__name__}, not an object")
            check(answer)
            if resp.status == 200 and path.startswith("/v3/kv/") and not _int_like_revision(answer):
                raise Malformed("no header.revision")
        except (ValueError, Malformed) as exc:
            raise DistStoreError(f"{name} did not answer {what} like an etcd member (HTTP {resp.status}: "
                                 f"{exc}: {resp.body[:100]!r})") from None
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
            sock = self._take(index, deadline)
            address = str(sock.getsockname()[0])
            self._give_back(index, sock)
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
        silent = self._silent_after(deadline)
        until = deadline if silent is None else time.monotonic() + silent
        buf = bytearray()
        try:
            with self.lock:
                self.requests += 1
            send(sock, request_bytes("POST", "/v3/watch", f"{host}:{port}", body, version="1.0"), until)
            status, _, _ = read_head(sock, until, buf)
        except Late:
            sock.close()
            if silent is not None:
                raise _TryNext(f"did not take the watch within {silent:.1f} s") from None
            raise _Timeout(self.names[index]) from None
        except (OSError, Malformed) as exc:
            sock.close()
            raise _TryNext(f"lost: {exc!r}") from None
        if status != 200:
            sock.close()
            raise _TryNext(f"watch refused: HTTP {status} {bytes(buf[:200])!r}")
        self.ever_answered = True
        stream = WatchStream(sock, bytes(buf), self.names[index])
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
        if stream.malformed and stream.member in self.names:  # its member sends what etcd does not: leave it
            self._move_on(self.names.index(stream.member))

    def close(self) -> None:
        """Close every connection; wakes the threads waiting on a watch."""
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
            streams = list(self.streams)
        for sock, _ in idle:
            sock.close()
        for stream in streams:
            try:
                stream.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _int_like_revision(answer: Json) -> bool:
    header = answer.get("header")
    return isinstance(header, dict) and "revision" in header
