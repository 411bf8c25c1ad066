"""TCPStore wire format, shared by the server and the client.

Connection set-up (mutual HMAC challenge-response; the secret never travels):
  client -> server   MAGIC (8 bytes) + client nonce (16)
  server -> client   frame: server nonce (16) + flags (1) + max value size (8)
                            + server proof (32: HMAC(secret, "server"|cn|sn), zeros without secret)
  client -> server   frame: client proof (32: HMAC(secret, "client"|sn|cn)) or empty
  server -> client   frame: status OK, or status ERROR + message, then close

Then request/response frames. A frame is a little-endian u32 length and a
body. A request body is an op byte and fields; a field is bytes (u32 length +
data), a list of them (u32 count + fields), an i64 or an f64. A response body
is a status byte and fields.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from enum import IntEnum

MAGIC = b"NCPGST01"
NONCE_SIZE = 16
PROOF_SIZE = 32
HELLO_SIZE = len(MAGIC) + NONCE_SIZE
FLAG_AUTH = 1
# Room for keys and framing around the largest value a frame may carry.
FRAME_OVERHEAD = 1 << 20

U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
F64 = struct.Struct("<d")
SERVER_HELLO = struct.Struct(f"<{NONCE_SIZE}sBq{PROOF_SIZE}s")


class Op(IntEnum):
    SET = 1
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


class Status(IntEnum):
    OK = 0
    TIMEOUT = 1  # field: the keys still missing
    ERROR = 2    # field: a message
    FATAL = 3    # field: a message; the server closes the connection after it


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def frame(body: bytes) -> bytes:
    return U32.pack(len(body)) + body


def pack_bytes(data: bytes) -> bytes:
    return U32.pack(len(data)) + data


def pack_list(items: list[bytes]) -> bytes:
    return U32.pack(len(items)) + b"".join(U32.pack(len(x)) + x for x in items)


class Reader:
    """Decodes the fields of one frame body; raises ValueError on malformed input."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("truncated field")
        data = bytes(self.buf[self.pos:end])
        self.pos = end
        return data

    def u8(self) -> int:
        return self._take(1)[0]

    def bytes(self) -> bytes:
        (n,) = U32.unpack(self._take(4))
        return self._take(n)

    def str(self) -> str:
        return self.bytes().decode()

    def list(self) -> list[bytes]:
        (n,) = U32.unpack(self._take(4))
        if n > len(self.buf):  # each item needs at least its 4-byte length
            raise ValueError("list count larger than the frame")
        return [self.bytes() for _ in range(n)]

    def str_list(self) -> list[str]:
        return [b.decode() for b in self.list()]

    def i64(self) -> int:
        return I64.unpack(self._take(8))[0]

    def f64(self) -> float:
        return F64.unpack(self._take(8))[0]

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise ValueError("trailing bytes in frame")
