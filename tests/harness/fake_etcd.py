"""A fake etcd member that misbehaves, for the EtcdStore's bounds
(tests/test_etcd_store_faults.py): a real TCP server on loopback that
answers /version as etcd 3.4 does (so that a store connects), then, to every
/v3/ request, the way its ``mode`` says:

- ``trickle``: a well-formed head, then the body one byte every 0.3 s;
- ``endless``: a chunked answer that never ends (64 KiB chunks);
- ``no-newline``: key reads answer "missing", and a watch streams bytes
  without ever a newline;
- ``shape:<json>``: HTTP 200 with that JSON (a wrongly shaped answer);
- ``frozen``: takes the request and never answers.

``answered`` lists (path, body bytes written) per answer, once it ended (so
a test can see that the client stopped reading).
"""

from __future__ import annotations

import json
import socket
import threading
import time

VERSION = b'{"etcdserver":"3.4.23","etcdcluster":"3.4.0"}'


class FakeMember:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self.answered: list[tuple[str, int]] = []  # (path, body bytes written), per answer ended
        self._closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not, on Linux)
        self.listener.close()

    def __enter__(self) -> FakeMember:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                while not self._closed.is_set():
                    path = self._request(conn)
                    if path is None:
                        return
                    if not self._answer(conn, path):
                        return
            except OSError:
                return

    def _request(self, conn: socket.socket) -> str | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        return head.split(b" ")[1].decode()

    def _answer(self, conn: socket.socket, path: str) -> bool:
        """Answer one request; False: the connection is done."""
        if path == "/version":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(VERSION), VERSION))
            return True
        sent = 0
        try:
            if self.mode == "trickle":
                body = b'{"header":{"revision":"2"}}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                for byte in body:
                    if self._closed.wait(0.3):
                        return False
                    conn.sendall(bytes([byte]))
                    sent += 1
                return True
            if self.mode == "endless":
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
                while not self._closed.is_set():
                    conn.sendall(chunk)
                    sent += 65536
                return False
            if self.mode == "no-newline":
                if path == "/v3/watch":
                    conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
                    block = b"y" * 65536
                    while not self._closed.is_set():
                        conn.sendall(block)
                        sent += len(block)
                    return False
                body = b'{"header":{"revision":"2"},"responses":[' + \
                    b",".join([b'{"response_range":{"header":{"revision":"2"}}}'] * 2) + b"]}"
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                return True
            if self.mode.startswith("shape:"):
                body = json.dumps(json.loads(self.mode[len("shape:"):])).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                return True
            if self.mode == "frozen":
                self._closed.wait(60)
                return False
            raise ValueError(f"unknown mode {self.mode!r}")
        finally:
            self.answered.append((path, sent))


def wait_until(condition, seconds: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
