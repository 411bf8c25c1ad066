"""torch.distributed's TCPStore wire protocol, as torch 2.13 speaks it.

Written from torch's sources (torch/csrc/distributed/c10d/: TCPStore.cpp, the
client; TCPStoreLibUvBackend.cpp, the default server; TCPStoreBackend.hpp,
the codes) for two uses: our client of a torch server (torch_client.py:
torchrun's agent store) and our server's torch connections (torch_server.py:
torch code under ``nccl-pg run``). The protocol is unauthenticated: see
docs/SECURITY.md.

A request is a query byte and its fields; answers carry no header. Integers
are the machine's byte order (little-endian on every platform torch ships
for); a string or a value is a u64 length and the bytes; a list of keys is a
u64 count and the keys (MULTI_SET's count is an i64). A connection's first
request is VALIDATE (the magic number; no answer); the client then sends
PING (a u32 nonce, echoed). Requests are answered in order, one at a time;
SET, APPEND, MULTI_SET and QUEUE_PUSH get no answer. WAIT and BARRIER are
answered STOP_WAITING when their keys are there, which may be never: the
client sends CANCEL_WAIT at its deadline and the server answers
WAIT_CANCELED (after a STOP_WAITING it had already sent, if any). The user's
keys carry the client's prefix "/" (torch's ``keyPrefix_``), which
``list_keys`` strips.
"""

from __future__ import annotations

import struct
from enum import IntEnum

VALIDATION_MAGIC = 0x3C85F7CE
KEY_PREFIX = "/"
# The limits of torch's libuv server (MAX_STRING_LEN, MAX_KEY_COUNT, MAX_PAYLOAD_LEN): our client keeps under
# them; our server applies the first two, and its own max_value_size to values.
MAX_KEY = 8 * 1024
MAX_KEYS = 128 * 1024
MAX_PAYLOAD = 8 * 1024 * 1024

U8 = struct.Struct("<B")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")


class Query(IntEnum):
    VALIDATE = 0     # u32 magic
    SET = 1          # key, value
    COMPARE_SET = 2  # key, expected, desired -> value
    GET = 3          # key -> value (b"" when missing: the client waits first)
    ADD = 4          # key, i64 -> i64
    CHECK = 5        # keys -> u8 READY / NOT_READY
    WAIT = 6         # keys -> u8 STOP_WAITING, when they are there
    GETNUMKEYS = 7   # -> i64
    DELETE_KEY = 8   # key -> i64 (values deleted)
    APPEND = 9       # key, value
    MULTI_GET = 10   # keys -> values
    MULTI_SET = 11   # i64 count, then key, value pairs
    CANCEL_WAIT = 12  # -> u8 WAIT_CANCELED
    PING = 13        # u32 nonce -> the nonce
    QUEUE_PUSH = 14  # key, value
    QUEUE_POP = 15   # key -> i64 length before the pop, then the value if it was > 0
    QUEUE_LEN = 16   # key -> i64
    LIST_KEYS = 17   # -> i64 count, then keys
    BARRIER = 18     # key, i64 world size -> u8 STOP_WAITING once that many arrived


READY, NOT_READY = 0, 1  # CheckResponseType
STOP_WAITING, WAIT_CANCELED = 0, 1  # WaitResponseType


def text(data: bytes) -> bytes:
    """A string or value field."""
    return U64.pack(len(data)) + data


def keys_field(keys: list[bytes]) -> bytes:
    return U64.pack(len(keys)) + b"".join(text(k) for k in keys)


def request(query: Query, *fields: bytes) -> bytes:
    return bytes((query,)) + b"".join(fields)


class Incomplete(Exception):
    """The buffer ends inside the request: read more."""


class Cursor:
    """Reads the fields of requests from a buffer; raises Incomplete when it
    ends too soon and ValueError for what breaks the protocol's limits."""

    __slots__ = ("buf", "pos", "end", "max_value")

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int, end: int, max_value: int) -> None:
        self.buf, self.pos, self.end, self.max_value = buf, pos, end, max_value

    def _take(self, n: int) -> bytes:
        stop = self.pos + n
        if stop > self.end:
            raise Incomplete
        data = bytes(self.buf[self.pos:stop])
        self.pos = stop
        return data

    def u32(self) -> int:
        return int(U32.unpack(self._take(4))[0])

    def i64(self) -> int:
        return int(I64.unpack(self._take(8))[0])

    def count(self) -> int:
        (n,) = U64.unpack(self._take(8))
        if n > MAX_KEYS:
            raise ValueError(f"{n} keys in one request; at most {MAX_KEYS}")
        return int(n)

    def _sized(self, limit: int, what: str) -> bytes:
        (n,) = U64.unpack(self._take(8))
        if n > limit:
            raise ValueError(f"a {what} of {n} bytes; at most {limit}")
        return self._take(n)

    def key(self) -> str:
        return self._sized(MAX_KEY, "key").decode()  # UnicodeDecodeError is a ValueError

    def value(self) -> bytes:
        return self._sized(self.max_value, "value")

    def keys(self) -> list[str]:
        return [self.key() for _ in range(self.count())]
