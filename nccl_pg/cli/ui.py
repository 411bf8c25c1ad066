"""The browser view of a job: ``nccl-pg run --ui [HOST:]PORT`` (served by
the launcher while its job runs) and ``nccl-pg why --ui [HOST:]PORT`` (a
job started elsewhere: torchrun, SLURM, another shell's `nccl-pg run`).

One page (ui_page/: plain HTML, JavaScript and SVG, no build step, nothing
fetched from elsewhere) and its data as JSON at ``/api/state``, for
scripts. Bound to the loopback address unless HOST says otherwise; every
request but the page's two static files must carry the random token of the
URL printed at the start (``?token=``, or ``Authorization: Bearer``), else
it gets 403. What the page shows is ui_state.py's.

The job is asked only when a page asks (``/api/state``): one inquiry at a
time, shared by the pages that ask meanwhile, none while no page is open;
the page asks again every few seconds while it is in view. Nothing runs
between requests.
"""

from __future__ import annotations

import argparse
import errno
import hmac
import json
import os
import secrets
import signal
import socket
import socketserver
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .. import env
from ..store import Store, TCPStore
from .ui_state import Job, View

LOOPBACK = "127.0.0.1"
TIMEOUT = 3.0  # seconds a look waits for the ranks' answers (as `nccl-pg why`'s default)
REQUEST_TIMEOUT = 30.0  # seconds a connection may take to send its request
EXIT_OK, EXIT_CANNOT_SERVE = 0, 2  # (`nccl-pg why --ui`: 2 as why's "no job to ask")
_STATIC = {"/ui.js": ("ui.js", "text/javascript; charset=utf-8"), "/ui.css": ("ui.css", "text/css; charset=utf-8")}
_HEADERS = {
    # The page loads only its own files and asks only its own server; nothing may frame it or learn its address.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
}


def address_arg(raw: str) -> tuple[str, int]:
    """``[HOST:]PORT`` (an IPv6 HOST in brackets): PORT alone binds the loopback address; 0 a free port."""
    host, sep, port = raw.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (sep and not host):
        raise argparse.ArgumentTypeError(f"expected [HOST:]PORT with PORT in 0..65535, got {raw!r}")
    return (host.strip("[]") if sep else LOOPBACK), int(port)


def add_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--ui", type=address_arg, metavar="[HOST:]PORT",
                        help=f"serve a live view of {what} in the browser at this address (PORT alone: "
                             f"{LOOPBACK}; 0: a free port); the URL printed holds its random token")


class PageError(Exception):
    """The page cannot be served (the address is taken, or cannot be bound)."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], view: View, token: str) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.view, self.token = view, token
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own looks up the host's fully qualified name, which can wait on DNS: not needed here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT
    server_version = "nccl-pg-ui"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        if url.path in _STATIC:
            name, kind = _STATIC[url.path]
            self._send(HTTPStatus.OK, kind, _page_file(name))
        elif url.path == "/favicon.ico":
            self._send(HTTPStatus.NO_CONTENT, "image/x-icon", b"")
        elif url.path not in ("/", "/api/state"):
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")
        elif not self._token_ok(url.query):
            self._send(HTTPStatus.FORBIDDEN, "text/plain; charset=utf-8",
                       b"forbidden: this address needs the token of the URL the job's page was announced with\n")
        elif url.path == "/":
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", _page_file("index.html"))
        else:
            try:
                body = json.dumps(self.server.view.state(), separators=(",", ":"), default=str).encode()
            except Exception as exc:  # a fault of ours: said to the page, which asks again later
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8",
                           f"could not look at the job: {type(exc).__name__}: {exc}\n".encode())
                return
            self._send(HTTPStatus.OK, "application/json", body)

    def _token_ok(self, query: str) -> bool:
        given = parse_qs(query).get("token", [""])[0]
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            given = auth[len("Bearer "):]
        return hmac.compare_digest(given.encode(), self.server.token.encode())

    def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for k, v in _HEADERS.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # a page asks every few seconds: nothing to say about it (and the token stays off the logs)


def _page_file(name: str) -> bytes:
    return resources.files(__package__).joinpath("ui_page").joinpath(name).read_bytes()


class Page:
    """The page's server, on threads of its own until ``close``."""

    def __init__(self, address: tuple[str, int], view: View) -> None:
        self.view = view
        self.token = secrets.token_urlsafe(18)
        try:
            self._server = _Server(address, view, self.token)
        except OSError as exc:
            taken = " (another process listens there: choose another port, or 0 for a free one)" \
                if exc.errno == errno.EADDRINUSE else ""
            raise PageError(f"cannot serve the page at {_hostport(*address)}: {exc.strerror or exc}{taken}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="nccl_pg-ui", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        shown = socket.gethostname() if host in ("0.0.0.0", "::") else str(host)
        return f"http://{_hostport(shown, int(port))}/?token={self.token}"

    def announce(self) -> str:
        """The line that gives the page's address."""
        exposed = "" if self._server.server_address[0] in (LOOPBACK, "::1", "localhost") else (
            "; it is reachable from other hosts: anyone with this URL sees the job's stacks")
        return f"the job's page: {self.url} (asks the job only while a page is open{exposed})"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tcp(host: str, port: int, secret: str | None, timeout: float) -> Callable[[], tuple[Store, Callable[[], None]]]:
    def connect() -> tuple[Store, Callable[[], None]]:
        client = TCPStore(host, port, secret=secret, timeout=timeout + 5.0, connect_timeout=min(timeout, 5.0))
        return client, client.close
    return connect


# --- the hooks of `nccl-pg run` and `nccl-pg why` -------------------------------------------------------


def launcher_page(address: tuple[str, int], store: tuple[str, int, str], nproc: int, command: Sequence[str],
                  gone: Callable[[], Mapping[int, str]], log: Callable[[str], None]) -> Page | None:
    """`nccl-pg run --ui`: the page of the launcher's job (its store, its ranks, how those that ended did),
    announced through ``log``; None, said through ``log``, when it cannot be served."""
    host, port, secret = store
    job = Job(f"nccl-pg run (launcher pid {os.getpid()}): {' '.join(command[1:])[:200]}", _tcp(host, port, secret,
              TIMEOUT), (host, port), nproc, gone, os.getpid(), "asked by the page of nccl-pg run --ui")
    try:
        page = Page(address, View(job, TIMEOUT, env.STACKS_SIGNAL.get()))
    except PageError as exc:
        log(f"--ui: {exc}")
        return None
    log(page.announce())
    return page


def why_page(args: argparse.Namespace, targets: Sequence[tuple[str, str, int, str | None, int | None]],
             connect: Callable[[str, int, str | None], tuple[Store, Callable[[], None]]], signum: int) -> int:
    """`nccl-pg why --ui`: serve the page of the one job ``targets`` names (why's), asked through ``connect``,
    until SIGINT or SIGTERM."""
    if len(targets) != 1:
        print(f"nccl-pg why --ui: {len(targets)} jobs to ask; the page shows one: choose it with --job PID or "
              "--store HOST:PORT", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    label, host, port, secret, world = targets[0]
    job = Job(label, lambda: connect(host, port, secret), (host, port), world, reason="asked by nccl-pg why --ui")
    try:
        page = Page(args.ui, View(job, args.timeout, signum, args.max_bytes))
    except PageError as exc:
        print(f"nccl-pg why --ui: {exc}", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"nccl-pg why: {label}\nnccl-pg why: {page.announce()}; Ctrl-C stops it", flush=True)
        stop.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        page.close()
    return EXIT_OK
