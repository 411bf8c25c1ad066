"""TCPStore wire format, shared by the server and the client.

Connection set-up (mutual HMAC challenge-response; the secret never travels):
  client -> server   MAGIC (8 bytes) + client nonce (16)
  server -> client   frame: server nonce (16) + flags (1) + max value size (i64) + idle timeout (f64, 0: none)
                            + server proof (32: HMAC(secret, "server"|cn|sn), zeros without secret)
  client -> server   frame: client proof (32: HMAC(secret, "client"|sn|cn)) or empty
  server -> client   answer with tag 0: status OK, or FATAL + message, then close

Before the client's proof is accepted the server reads nothing beyond these
two messages (HELLO_SIZE bytes, then a frame of at most PROOF_SIZE bytes).

Then requests and answers. A frame is a little-endian u32 length and a body.
A request body is an op byte, a u32 tag chosen by the client (never 0) and
fields; a field is bytes (u32 length + data), a list of them (u32 count +
fields), an i64 or an f64. An answer body is the request's tag, a status byte
and fields. The server handles a connection's requests in order, but a
blocking request (get, wait, multi_get, queue_pop) does not hold up the ones
behind it: its answer comes when it can be given, so answers may arrive out
of order, and the tag pairs them with their requests. SET is never answered
when it succeeds (like torch's); any failure of a SET closes the connection
with a FATAL answer. Answers with tag 0 concern the connection: FATAL (the
server closes it) and GOAWAY (idle too long: no request after this answer
was handled, the client reconnects).
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import struct
from enum import IntEnum

MAGIC = b"NCPGST02"
NONCE_SIZE = 16
PROOF_SIZE = 32
HELLO_SIZE = len(MAGIC) + NONCE_SIZE
FLAG_AUTH = 1
# Room for keys and framing around the largest value a frame may carry.
FRAME_OVERHEAD = 1 << 20

U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
F64 = struct.Struct("<d")
_U32_FROM, _U32_PACK = U32.unpack_from, U32.pack
SERVER_HELLO = struct.Struct(f"<{NONCE_SIZE}sBqd{PROOF_SIZE}s")
REQUEST_HEAD = struct.Struct("<IBI")  # frame length, op, tag
ANSWER_HEAD = struct.Struct("<IIB")   # frame length, tag, status
CONNECTION_TAG = 0


class Op(IntEnum):
    SET = 1           # key, value -> no answer
    GET = 2           # key, timeout -> value (waits)
    ADD = 3           # key, i64 -> i64
    COMPARE_SET = 4   # key, expected, desired -> value
    WAIT = 5          # keys, timeout -> ()
    CHECK = 6         # keys -> i64 (0/1)
    DELETE = 7        # key -> i64 (0/1)
    NUM_KEYS = 8      # -> i64
    MULTI_GET = 9     # keys, timeout -> values
    MULTI_SET = 10    # keys, values -> ()
    APPEND = 11       # key, value -> ()
    PING = 12         # -> ()
    QUEUE_PUSH = 13   # key, value -> ()
    QUEUE_POP = 14    # key, timeout (0: do not wait) -> value, or EMPTY
    QUEUE_LEN = 15    # key -> i64
    LIST_KEYS = 16    # -> keys


class Status(IntEnum):
    OK = 0
    TIMEOUT = 1  # field: the keys still missing
    ERROR = 2    # field: a message
    FATAL = 3    # field: a message; the server closes the connection after it
    GOAWAY = 4   # field: a message; the server handled nothing after it and closes
    EMPTY = 5    # queue_pop without waiting found the queue empty


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def frame(body: bytes) -> bytes:
    return U32.pack(len(body)) + body


def request(op: Op, tag: int, fields: bytes = b"") -> bytes:
    return REQUEST_HEAD.pack(5 + len(fields), op, tag) + fields


def answer(tag: int, status: Status, fields: bytes = b"") -> bytes:
    return ANSWER_HEAD.pack(5 + len(fields), tag, status) + fields


def pack_bytes(data: bytes) -> bytes:
    return U32.pack(len(data)) + data


def pack_list(items: list[bytes]) -> bytes:
    parts = [U32.pack(len(items))]
    for x in items:
        parts += (_U32_PACK(len(x)), x)
    return b"".join(parts)


class Reader:
    """Decodes the fields of one frame body; raises ValueError on malformed input."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: builtins.bytes | bytearray | memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def _take(self, n: int) -> builtins.bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("truncated field")
        data = builtins.bytes(self.buf[self.pos:end])
        self.pos = end
        return data

    def u8(self) -> int:
        return self._take(1)[0]

    def bytes(self) -> builtins.bytes:
        buf, pos = self.buf, self.pos
        if pos + 4 > len(buf):
            raise ValueError("truncated field")
        end = pos + 4 + _U32_FROM(buf, pos)[0]
        if end > len(buf):
            raise ValueError("truncated field")
        self.pos = end
        return builtins.bytes(buf[pos + 4:end])

    def str(self) -> builtins.str:
        return self.bytes().decode()

    def list(self) -> builtins.list[builtins.bytes]:
        # One loop over the items rather than two method calls per item: a multi_get's keys, on every request.
        buf, pos, size = self.buf, self.pos, len(self.buf)
        if pos + 4 > size:
            raise ValueError("truncated field")
        (n,) = _U32_FROM(buf, pos)
        if n > size:  # each item needs at least its 4-byte length
            raise ValueError("list count larger than the frame")
        pos += 4
        items = []
        for _ in range(n):
            if pos + 4 > size:
                raise ValueError("truncated field")
            end = pos + 4 + _U32_FROM(buf, pos)[0]
            if end > size:
                raise ValueError("truncated field")
            items.append(builtins.bytes(buf[pos + 4:end]))
            pos = end
        self.pos = pos
        return items

    def str_list(self) -> builtins.list[builtins.str]:
        return [b.decode() for b in self.list()]

    def i64(self) -> int:
        return I64.unpack(self._take(8))[0]

    def f64(self) -> float:
        return F64.unpack(self._take(8))[0]

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise ValueError("trailing bytes in frame")
