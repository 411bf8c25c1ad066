"""The bytes between EtcdStore and one etcd member: an HTTP exchange that
ends by its deadline whatever the member does (a real deadline: each read
waits at most for what is left of it, so a member that trickles one byte at
a time does not hold it up), answers and watch lines bounded in size, and
etcd's JSON checked for the shape the store reads (anything else is a
``Malformed`` naming what was wrong, which the client turns into a
DistStoreError naming the member).
"""

from __future__ import annotations

import base64
import binascii
import socket
import time
from dataclasses import dataclass
from typing import Any

# The largest answer read: a transaction of READS_PER_TXN ranges whose values are each at most 3 MiB (etcd's
# --max-request-bytes is 1.5 MiB by default), base64 (4/3) in JSON, fits; a member sending more is wrong.
READS_PER_TXN = 32
MAX_ANSWER = 128 << 20
# The largest watch message (one line): etcd sends each event once, as large as the value put (<= 1.5 MiB by
# default, base64), and fragments larger responses when asked to; several events of one revision share a line.
MAX_LINE = 64 << 20
MAX_HEAD = 64 << 10  # status line and headers
_READ = 64 * 1024


class Malformed(Exception):
    """The member's answer is not what etcd sends (detail in the message)."""


class Late(Exception):
    """The deadline passed before the answer was complete."""


@dataclass
class Answer:
    status: int
    body: bytes
    close: bool  # the member closes the connection after it


def _recv(sock: socket.socket, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Late
    sock.settimeout(left)
    try:
        chunk = sock.recv(_READ)
    except TimeoutError:
        raise Late from None
    if not chunk:
        raise ConnectionResetError("the member closed the connection before its answer was complete")
    return chunk


def request_bytes(method: str, path: str, host: str, body: bytes | None, version: str = "1.1") -> bytes:
    head = f"{method} {path} HTTP/{version}\r\nHost: {host}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + (body or b"")


def send(sock: socket.socket, data: bytes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Late
    sock.settimeout(left)  # sendall: the total time (Python >= 3.5)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise Late from None


def read_head(sock: socket.socket, deadline: float, buf: bytearray) -> tuple[int, dict[str, str], bool]:
    """Status, headers (lower-case names) and whether the connection closes
    after this answer; ``buf`` keeps what was read past the head."""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        if len(buf) > MAX_HEAD:
            raise Malformed(f"an answer head over {MAX_HEAD} bytes")
        buf += _recv(sock, deadline)
    head = bytes(buf[:end]).decode("latin-1")
    del buf[:end + 4]
    lines = head.split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise Malformed(f"not an HTTP answer: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise Malformed(f"a header line without a colon: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    close = parts[0] == "HTTP/1.0" or headers.get("connection", "").lower() == "close"
    return int(parts[1]), headers, close


def read_answer(sock: socket.socket, deadline: float) -> Answer:
    """One whole answer (Content-Length, chunked, or until the member
    closes), by ``deadline`` (Late) and at most MAX_ANSWER bytes (Malformed)."""
    buf = bytearray()
    status, headers, close = read_head(sock, deadline, buf)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return Answer(status, _chunked(sock, deadline, buf), close)
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit() or int(length) > MAX_ANSWER:
            raise Malformed(f"Content-Length {length[:40]!r} (at most {MAX_ANSWER} bytes are read)")
        while len(buf) < int(length):
            buf += _recv(sock, deadline)
        return Answer(status, bytes(buf[:int(length)]), close)
    while True:  # no length: the answer ends with the connection
        try:
            buf += _recv(sock, deadline)
        except ConnectionResetError:
            return Answer(status, bytes(buf), True)
        if len(buf) > MAX_ANSWER:
            raise Malformed(f"an answer over {MAX_ANSWER} bytes")


def _chunked(sock: socket.socket, deadline: float, buf: bytearray) -> bytes:
    body = bytearray()
    while True:
        while (end := buf.find(b"\r\n")) < 0:
            if len(buf) > 1024:
                raise Malformed("a chunk size line over 1 KiB")
            buf += _recv(sock, deadline)
        try:
            size = int(bytes(buf[:end]).split(b";")[0], 16)
        except ValueError:
            raise Malformed(f"a chunk size {bytes(buf[:end][:40])!r}") from None
        del buf[:end + 2]
        if len(body) + size > MAX_ANSWER:
            raise Malformed(f"a chunked answer over {MAX_ANSWER} bytes")
        while len(buf) < size + 2:
            buf += _recv(sock, deadline)
        body += buf[:size]
        del buf[:size + 2]
        if size == 0:
            return bytes(body)


# --- etcd's JSON --------------------------------------------------------------------------------------------

_INTS = ("revision", "count", "create_revision", "mod_revision", "version", "lease")
_B64 = ("key", "value")


def check(value: Any, where: str = "answer") -> Any:
    """``value`` (etcd's decoded JSON) when every field the store reads has
    its type: ints (etcd sends int64 as strings), base64 keys and values,
    lists of kvs and of transaction responses; else Malformed."""
    if isinstance(value, dict):
        for name, item in value.items():
            if name in _INTS and not _int_like(item):
                raise Malformed(f"{where}.{name} is {item!r:.60}, not an integer")
            if name in _B64 and not _b64_like(item):
                raise Malformed(f"{where}.{name} is {item!r:.60}, not base64")
            if name == "succeeded" and not isinstance(item, bool):
                raise Malformed(f"{where}.succeeded is {item!r:.60}, not a boolean")
            if name in ("kvs", "responses", "events") and not isinstance(item, list):
                raise Malformed(f"{where}.{name} is {type(item).__name__}, not a list")
            if name in ("header", "kv", "result") and not isinstance(item, dict):
                raise Malformed(f"{where}.{name} is {type(item).__name__}, not an object")
            check(item, f"{where}.{name}")
        if "responses" in value and not all(isinstance(r, dict) and len(r) == 1
                                            and isinstance(next(iter(r.values())), dict)
                                            for r in value["responses"]):
            raise Malformed(f"{where}.responses holds something else than one response per operation")
        if "kvs" in value and not all(isinstance(kv, dict) and "key" in kv for kv in value["kvs"]):
            raise Malformed(f"{where}.kvs holds something else than key-values")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check(item, f"{where}[{i}]")
    return value


def _int_like(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    return isinstance(v, str) and v.lstrip("-").isdigit() and len(v) < 24


def _b64_like(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True
