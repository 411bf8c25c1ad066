"""The record `nccl-pg run` keeps of a running job, so that `nccl-pg why`
with no arguments finds the jobs this user started on this machine.

One file per launcher, ``run-<pid>.json``, in this user's runtime folder
(``folder``: found whatever TMPDIR the launcher, the ranks or `nccl-pg why`
run with; made 0700 and refused unless it is this user's), written 0600
through a temporary file renamed into place, removed when the launcher
exits. It holds the store's address and secret (which the
ranks also have in their environment), the launcher's pid and start time
(to tell a record left by a launcher that was killed from a live one: the
pid may be reused), the number of ranks and the command.

Reading treats each file as untrusted: no symbolic link followed, a regular
file of this user's of at most ``MAX_BYTES``, JSON with fields of the
expected types; anything else is skipped with a note. A record whose
launcher is gone is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .. import env, process_tree
from ..diagnostics import dump

MAX_BYTES = 64 * 1024
_PREFIX, _SUFFIX = "run-", ".json"


@dataclass(frozen=True)
class Job:
    launcher_pid: int
    start_time: int  # the launcher's start time, in clock ticks since boot (/proc/<pid>/stat field 22)
    host: str
    port: int
    secret: str
    nproc: int
    command: list[str]
    started: float  # wall clock

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def folder(environ: Mapping[str, str] | None = None) -> str:
    """Where this user's launchers keep their records, whatever TMPDIR says
    (a rank, a shell and `nccl-pg why` may each have their own):
    ``NCCL_PG_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/nccl_pg`` when that is
    a folder of this user's, else ``/tmp/nccl_pg-<uid>/jobs``. Made 0700,
    refused unless this user's."""
    environ = os.environ if environ is None else environ
    given = env.RUNTIME_DIR.get(environ)
    if given is not None:
        os.makedirs(given, mode=0o700, exist_ok=True)
        return dump.own_folder(given)
    xdg = environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        with contextlib.suppress(OSError):
            st = os.stat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                return dump.own_folder(os.path.join(xdg, "nccl_pg"))
    base = dump.own_folder(f"/tmp/nccl_pg-{os.getuid()}")
    return dump.own_folder(os.path.join(base, "jobs"))


def _folders() -> list[str]:
    """Where records may be: this version's folder, and where earlier ones kept them (``<TMPDIR>/nccl_pg-<uid>/jobs``)."""
    out = []
    with contextlib.suppress(OSError):
        out.append(folder())
    with contextlib.suppress(OSError):
        old = os.path.join(dump.private_dir(), "jobs")
        if os.path.isdir(old) and old not in out:
            out.append(old)
    return out


def searched() -> list[str]:
    """The folders ``running`` looks in (for a message that says where)."""
    out = []
    with contextlib.suppress(OSError):
        out.append(folder())
    out.append(os.path.join(os.path.join(tempfile.gettempdir(), f"nccl_pg-{os.getuid()}"), "jobs"))
    return list(dict.fromkeys(out))


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (None if it is gone)."""
    try:
        return int(process_tree.stat(pid)[19])  # stat's field 22, starttime
    except (OSError, ValueError, IndexError):
        return None


def write(host: str, port: int, secret: str, nproc: int, command: list[str]) -> str:
    """This launcher's record; returns its path (remove it with ``remove``)."""
    pid = os.getpid()
    job = Job(pid, start_time(pid) or 0, host, port, secret, nproc, list(command), time.time())
    path = os.path.join(folder(), f"{_PREFIX}{pid}{_SUFFIX}")
    dump.write_whole(path, lambda f: f.write(json.dumps(asdict(job)).encode()), ".run-")
    return path


def remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _parse(data: Any) -> Job:
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    ints = {k: data.get(k) for k in ("launcher_pid", "start_time", "port", "nproc")}
    for k, v in ints.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{k} is not a non-negative integer")
    if not 1 <= ints["port"] <= 65535:  # type: ignore[operator]
        raise ValueError("port is not a TCP port")
    for k in ("host", "secret"):
        if not isinstance(data.get(k), str) or len(data[k]) > 1024:
            raise ValueError(f"{k} is not a string")
    command = data.get("command")
    if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        raise ValueError("command is not a list of strings")
    started = data.get("started")
    if isinstance(started, bool) or not isinstance(started, (int, float)):
        raise ValueError("started is not a number")
    return Job(data["launcher_pid"], data["start_time"], data["host"], data["port"], data["secret"], data["nproc"],
               command, float(started))


def read(path: str) -> Job:
    """One record, from an untrusted file (ValueError saying why)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError("a symbolic link" if os.path.islink(path) else (exc.strerror or str(exc))) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError("not a regular file of this user's")
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise ValueError(f"over {MAX_BYTES} bytes")
    try:
        return _parse(json.loads(raw))
    except (ValueError, RecursionError) as exc:
        raise ValueError(str(exc)) from None


def running() -> tuple[list[Job], list[str]]:
    """The live jobs' records (oldest first), and notes on the files skipped;
    records of launchers that are gone are removed."""
    jobs, notes = [], []
    paths = []
    for where in _folders():
        try:
            paths += [os.path.join(where, n) for n in sorted(os.listdir(where))
                      if n.startswith(_PREFIX) and n.endswith(_SUFFIX)]
        except OSError as exc:
            notes.append(f"no job records in {where}: {exc}")
    for path in paths:
        try:
            job = read(path)
        except ValueError as exc:
            notes.append(f"{path}: not a job record ({exc}); skipped")
            continue
        if start_time(job.launcher_pid) != job.start_time:
            remove(path)  # its launcher was killed before it could remove it
            continue
        jobs.append(job)
    return sorted(jobs, key=lambda j: j.started), notes
