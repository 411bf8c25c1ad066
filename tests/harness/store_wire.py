"""Raw wire helpers for the TCPStore tests that speak the protocol by hand
(malformed frames, half-open connections, limits)."""

from __future__ import annotations

import os
import socket
import struct

from nccl_pg.store import protocol as P

HOST = "127.0.0.1"
OK_ANSWER = P.answer(P.CONNECTION_TAG, P.Status.OK)[4:]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"connection closed after {len(data)} of {n} bytes"
        data += chunk
    return bytes(data)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    return recv_exact(sock, n)


def hello(port: int) -> socket.socket:
    """A hand-made client that has sent its greeting and read the server's challenge."""
    sock = socket.create_connection((HOST, port), timeout=10)
    sock.sendall(P.MAGIC + os.urandom(P.NONCE_SIZE))
    recv_frame(sock)
    return sock


def raw_connect(port: int, proof: bytes = b"") -> socket.socket:
    """A hand-made client through the handshake; returns the ready socket."""
    sock = hello(port)
    sock.sendall(P.frame(proof))
    assert recv_frame(sock) == OK_ANSWER
    return sock
