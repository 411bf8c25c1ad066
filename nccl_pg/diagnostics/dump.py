"""Debug dumps: what this process was doing when something went wrong.

A dump is one file per rank, ``<prefix><global rank>``: a pickled dict in
PyTorch's flight-recorder layout (version, pg_config, pg_status, entries),
so PyTorch's analyzer and ``nccl-pg trace`` both read it, plus our own keys:
the reason, every live group's pending operations with their age, and the
Python stack of every thread. Written on a timeout (on every rank, through
a store signal), by the heartbeat monitor before it ends the process, when
a byte is written to ``<prefix><rank>.pipe``, and on request (``write``).

The prefix is ``NCCL_PG_DEBUG_INFO_TEMP_FILE``, by default in a private
directory, ``<tmp>/nccl_pg-<uid>/`` (made 0700, refused unless it is this
user's), not in world-writable /tmp. A dump is written to a temporary file
(``mkstemp``: never through a planted link) in the same directory and
renamed into place; a writer killed mid-dump leaves its temporary file,
which the next dump on that host removes.

Reading (``read``) treats a file as untrusted: no symbolic link followed, a
file not owned by this user refused, and pickles loaded by an unpickler that
resolves no global (our dumps and PyTorch's hold only plain data), so no
code runs from a dump's bytes; what decoding may cost is bounded first
(``untrusted``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from .. import env, process_tree
from . import flight_recorder, untrusted
from .group_view import GroupView
from .untrusted import NotADump as NotADump  # raised by read; defined where decoding is


def _group(view: GroupView) -> dict[str, Any]:
    a = view.activity()
    now = time.monotonic()
    return {
        "uid": view.uid, "desc": view.desc, "name": view.name, "rank": view.rank, "size": view.size,
        "ranks": view.global_ranks(),
        "backend": view.backend, "issued": a.issued, "completed": a.completed, "p2p_issued": a.p2p_issued,
        "state": view.state() or "open",
        "pending": [{"op": p.op, "seq": p.seq, "age_s": round(now - p.issued, 3)}
                    for p in sorted(a.pending, key=lambda p: p.seq)],
    }


def _threads() -> dict[str, list[str]]:
    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, '?')} ({ident})": traceback.format_stack(frame)
            for ident, frame in sys._current_frames().items()}  # noqa: SLF001 - the stdlib's one way to them


def report(reason: str, rank: int, groups: Sequence[GroupView]) -> dict[str, Any]:
    """The dump as a dict (the flight recorder's layout plus our keys)."""
    out = flight_recorder.get().dump(groups)
    out.update({"reason": reason, "rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                "time": time.time(), "job": job_id(), "groups": [_group(g) for g in groups], "threads": _threads()})
    return out


# The largest file read as a dump (ours: under 1 MB for the default 2,000 entries).
MAX_DUMP_BYTES = untrusted.MAX_BYTES
_TMP = ".nccl_pg_dump."  # temporary files: <_TMP><host>.<pid>.<random>.tmp


def own_folder(path: str) -> str:
    """``path``, made 0700 if it is not there, and refused (OSError) unless
    it is a directory of this user's (someone else may have made it first,
    or planted a link there)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{path} is not a directory of this user's (uid {os.getuid()})")
    return path


def private_dir() -> str:
    """``<tmp>/nccl_pg-<uid>``: made 0700 (also when someone loosened it), and
    refused unless it is a directory of this user's."""
    path = os.path.join(tempfile.gettempdir(), f"nccl_pg-{os.getuid()}")
    try:
        own_folder(path)
    except OSError as exc:
        raise OSError(f"the default dump directory: {exc}; set NCCL_PG_DEBUG_INFO_TEMP_FILE to a path prefix in a "
                      "private directory") from None
    if stat.S_IMODE(os.lstat(path).st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


JOB_FOLDER = "job-"  # <private dir>/job-<id>: a job's dumps, reports, C-level stacks (jobs_folder.py)
_UNSAFE_ID = re.compile(r"[^A-Za-z0-9._-]")


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """This process's job id: ``NCCL_PG_JOB_ID`` (set by `nccl-pg run` and
    the test harness), else torchelastic's run id (torchrun; not its default
    "none") or SLURM's job and step, made safe as a folder name; None
    without any (a plain env:// launch)."""
    environ = os.environ if environ is None else environ
    own = env.JOB_ID.get(environ)
    if own is not None:
        return own
    run = environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return _UNSAFE_ID.sub("_", f"torch-{run}")[:64]
    if environ.get("SLURM_JOB_ID"):
        return _UNSAFE_ID.sub("_", f"slurm-{environ['SLURM_JOB_ID']}.{environ.get('SLURM_STEP_ID', '0')}")[:64]
    return None


def job_folder(job: str) -> str:
    """The job's folder, ``<tmp>/nccl_pg-<uid>/job-<id>`` (made 0700, refused unless this user's)."""
    return own_folder(os.path.join(private_dir(), JOB_FOLDER + job))


def prefix() -> str:
    """The path prefix of this process's dumps (the rank is appended):
    ``NCCL_PG_DEBUG_INFO_TEMP_FILE``, else in the job's own folder, else in
    the private folder."""
    configured = env.DUMP_FILE.get()
    if configured is not None:
        return configured
    job = job_id()
    return os.path.join(job_folder(job) if job is not None else private_dir(), "nccl_pg_trace_rank_")


def path_for(rank: int) -> str:
    path = f"{prefix()}{rank}"
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    return path


_last_written: float | None = None  # time.monotonic() of this process's last dump


def written_within(seconds: float) -> bool:
    """Whether this process wrote a dump in the last ``seconds``."""
    return _last_written is not None and time.monotonic() - _last_written < seconds


def write(reason: str, rank: int, groups: Sequence[GroupView]) -> str:
    """Write this rank's dump; returns its path."""
    global _last_written
    path = path_for(rank)
    folder = os.path.dirname(path) or "."
    _remove_stale_temps(folder)
    # A dot name (and .tmp): readers globbing for <prefix><rank> (PyTorch's analyzer, nccl-pg trace) skip it.
    write_whole(path, lambda f: pickle.dump(report(reason, rank, groups), f),
                f"{_TMP}{socket.gethostname()}.{os.getpid()}.")
    _last_written = time.monotonic()
    return path


def write_whole(path: str, fill: Callable[[IO[bytes]], object], temp_prefix: str) -> None:
    """``path`` written by ``fill`` all at once: through a temporary file in
    its folder (``mkstemp``: 0600, never through a planted link) renamed into
    place, so that a reader never sees half of it; the temporary file goes if
    writing fails."""
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix, suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _remove_stale_temps(folder: str) -> None:
    """Temporary files of this host's writers that died mid-dump (their pid
    is gone); only this user's."""
    mine = f"{_TMP}{socket.gethostname()}."
    try:
        names = [n for n in os.listdir(folder) if n.startswith(mine) and n.endswith(".tmp")]
    except OSError:
        return
    for n in names:
        pid = n[len(mine):].split(".", 1)[0]
        if not pid.isdigit() or process_tree.alive(int(pid)):
            continue
        p = os.path.join(folder, n)
        with contextlib.suppress(OSError):
            if os.lstat(p).st_uid == os.getuid():
                os.unlink(p)


def read(path: str) -> dict[str, Any]:
    """A dump written by us or by PyTorch (pickle), or a JSON dump, from an
    untrusted file: NotADump (saying why) for a link, a file that is not this
    user's or not a regular file, one too large, or bytes that do not decode
    to a dict of plain data within the bounds of ``untrusted``."""
    return read_decoded(path).value


def read_decoded(path: str) -> untrusted.Decoded:
    """``read``, with what decoding the file built (``Decoded.values``)."""
    return untrusted.decode(read_bytes(path, MAX_DUMP_BYTES))


def read_bytes(path: str, limit: int) -> bytes:
    """The bytes of an untrusted file: NotADump for a link (not followed), a
    file that is not regular or not this user's, or one over ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if os.path.islink(path):
            raise NotADump("a symbolic link (not followed)") from None
        raise NotADump(exc.strerror or str(exc)) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise NotADump("not a regular file")
        if st.st_uid != os.getuid():
            raise NotADump(f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()}): refused")
        if st.st_size > limit:
            raise NotADump(f"{st.st_size} bytes, over the {limit}-byte limit")
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew after fstat
        raise NotADump(f"over the {limit}-byte limit")
    return data
