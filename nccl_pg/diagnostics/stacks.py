"""Stacks when Python cannot answer: C-level dumps of every thread's Python
stack (``faulthandler``), which work while a thread holds the GIL or is
stuck in C, where the diagnosis threads (Python) cannot run.

The convention, here and nowhere else: a rank keeps its C-level stacks in
``<dump dir>/c_stacks/rank<rank>.<pid>.txt`` (``path``; the dump dir is the
folder of ``NCCL_PG_DEBUG_INFO_TEMP_FILE``), 0600 in a 0700 folder, a header
line naming the rank, pid, host and main thread (``header``,
``parse_header``), then what faulthandler appends. The folder keeps the
files out of torch's analyzer's way: ``fr_trace`` walks the dump folder and
its subfolders and reads every file whose name contains the dump prefix as
a dump (a ``<prefix><rank>.stacks`` file ends its run with a ValueError);
these names hold no prefix. One writer per process (``this_process``),
driven by the watchdog and also armed by the test harness before its rank
joins a group:

- on a signal (``NCCL_PG_STACKS_SIGNAL``, SIGUSR2 by default): a C-level
  handler, which ``nccl-pg why``, ``nccl-pg run`` and the test harness send
  to a rank on their host that does not answer (``request``);
- after the deadline of the operations in flight: a timer (one per
  process, faulthandler's) set by the watchdog's poller to the earliest
  deadline of the pending operations plus ``TIMER_MARGIN``. The margin lets
  the Python diagnosis have the first word: a process that can run Python
  has failed (or finished) the operation by then and the poller moves the
  timer away, so it fires only in a process whose Python is stuck. (A
  C-level dump reads the thread list without the GIL; one taken while other
  threads start or end, as they do while a timeout is diagnosed and the
  process ends, can crash the process.) Nothing is added to issuing an
  operation: the poller moves the timer, and only when it is about to expire
  or no longer points at a pending operation, so a job whose operations
  complete re-arms it about once per timeout. An operation issued less than
  a poll before the GIL is taken can be missed by the timer; the signal
  still works.

For the readers: which local processes are the ranks of a job
(``find_ranks``: ``MASTER_PORT`` and ``RANK`` in their environment, this
user's only), whether a process has the handler (its ``SigCgt`` mask: a
signal without one would kill it), the file it writes to (its open
descriptors), the files of a dump folder (``find``), and a file or what a
handler wrote read back as untrusted input (no link followed, this user's
regular file, at most ``cap`` bytes), into threads (``Written.threads``,
parsed by ``frames``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import faulthandler
import logging
import os
import re
import signal
import socket
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from .. import env, process_tree
from . import dump, frames
from .untrusted import NotADump

log = logging.getLogger(__name__)

FOLDER = "c_stacks"  # beside the dumps (see the module's docstring for why a folder)
_NAME = re.compile(r"rank(\d+)\.(\d+)\.txt")
_HEADER = re.compile(r"# nccl_pg C-level stacks: rank (?P<rank>\d+), pid (?P<pid>\d+), host (?P<host>\S{1,255}), "
                     r"main thread (?P<main>0x[0-9a-fA-F]{1,16})(, job (?P<job>[A-Za-z0-9._-]{1,64}))?\s*")
MAX_BYTES = 4 << 20  # of a stacks file read back (faulthandler's dumps: about 5-20 kB each)
# The timer fires this long after the earliest deadline (the diagnosis's budget and reading time are at most 4 s).
TIMER_MARGIN = 5.0
# The timer is moved when it would expire within this many polls (or a second) of now.
_REARM_POLLS = 2
_REARM_MIN = 1.0


def path(dump_dir: str, rank: int, pid: int) -> str:
    """Where rank ``rank``'s process ``pid`` keeps its C-level stacks."""
    return os.path.join(dump_dir, FOLDER, f"rank{rank}.{pid}.txt")


def header(rank: int, pid: int, host: str, main: int, job: str | None = None) -> str:
    return (f"# nccl_pg C-level stacks: rank {rank}, pid {pid}, host {host}, main thread 0x{main:016x}"
            + (f", job {job}" if job else "") + "\n")


def parse_header(line: str) -> dict[str, Any]:
    """A stacks file's header line: {"rank", "pid", "host", "main", "job"}, or {} if it is not one."""
    m = _HEADER.fullmatch(line)
    if m is None:
        return {}
    return {"rank": int(m.group("rank")), "pid": int(m.group("pid")), "host": m.group("host"),
            "main": int(m.group("main"), 16), "job": m.group("job")}


class CStacks:
    """This process's C-level stack dumps (see the module's docstring); one
    per process: ``this_process``."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.pid = os.getpid()
        self.file: IO[str] | None = None
        self.path: str | None = None
        self.armed: float | None = None  # time.monotonic() at which the timer fires
        self.fired: float = float("-inf")  # the newest deadline the timer was armed for and passed
        self._failed = False
        self._header = 0

    def open(self, rank: int) -> bool:
        """The file and the signal handler, once; False if they cannot be had."""
        if self.file is not None or self._failed:
            return self.file is not None
        try:
            folder = dump.own_folder(os.path.join(os.path.dirname(dump.path_for(rank)) or ".", FOLDER))
            where = path(os.path.dirname(folder), rank, os.getpid())
            fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                os.close(fd)
                raise OSError(f"{where} is not a regular file of this user's")
            f = os.fdopen(fd, "w")
            line = header(rank, os.getpid(), socket.gethostname(), threading.main_thread().ident or 0, dump.job_id())
            f.write(line)
            f.flush()
            self._header = len(line.encode())
        except OSError as exc:
            log.warning("nccl_pg: no C-level stack dumps for rank %d: %s", rank, exc)
            self._failed = True
            return False
        self.file, self.path = f, where
        if self.signum:
            previous = signal.getsignal(self.signum)
            # chain to a handler someone installed (None: one installed from C), never to the default action,
            # which would end the process
            chain = previous not in (signal.SIG_DFL, signal.SIG_IGN)
            faulthandler.register(self.signum, file=f, all_threads=True, chain=chain)
        atexit.register(self.close)
        return True

    def keep(self, deadline: float | None, interval: float) -> None:
        """The poller's move (it polls every ``interval`` seconds):
        ``deadline`` is the earliest deadline of the operations pending now
        (time.monotonic()), None when none is."""
        if self.file is None:
            return
        window = max(_REARM_POLLS * interval, _REARM_MIN)
        if deadline is not None:
            deadline += TIMER_MARGIN
        now = time.monotonic()
        if self.armed is not None and self.armed <= now:  # it fired (or was about to): not armed any more
            self.fired, self.armed = max(self.fired, self.armed), None
        if deadline is None or deadline <= self.fired:
            if self.armed is not None and self.armed - now < window:
                faulthandler.cancel_dump_traceback_later()
                self.armed = None
            return
        if self.armed is not None and self.armed <= deadline and self.armed - now >= window:
            return  # fires no later than needed, and not soon: leave it
        if self.armed is not None and abs(self.armed - deadline) < 1e-3:
            return
        faulthandler.dump_traceback_later(max(deadline - now, 0.001), repeat=False, file=self.file, exit=False)
        self.armed = deadline

    def cancel(self) -> None:
        """No timer from now on (the process is ending: a dump during its teardown could crash it)."""
        self.fired = float("inf")
        if self.armed is not None:
            faulthandler.cancel_dump_traceback_later()
            self.armed = None

    def close(self) -> None:
        """At exit: no timer fires during the interpreter's shutdown, and a
        file nothing was written to (but its header) goes. Only in the
        process that opened it (a forked child's exit leaves it)."""
        if os.getpid() != self.pid:
            return
        self.cancel()
        if self.file is None or self.path is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self.file.fileno()).st_size <= self._header:
                os.unlink(self.path)
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(self.path))  # the last rank's file of the folder


_this: CStacks | None = None
_this_lock = threading.Lock()


def this_process() -> CStacks:
    """This process's writer (a forked child gets its own): one file, one
    handler and one timer per process, as faulthandler has one timer per
    process; its signal is ``NCCL_PG_STACKS_SIGNAL`` (0: none)."""
    global _this
    with _this_lock:
        if _this is None or _this.pid != os.getpid():
            _this = CStacks(env.STACKS_SIGNAL.get())
        return _this


# --- readers --------------------------------------------------------------------------------------


@dataclass
class Written:
    """What a rank's C-level handler wrote, read back: the file's ``path``,
    its header line, and the ``text`` faulthandler wrote (all of the file's,
    or what one request added)."""

    path: str
    header: str
    text: str

    @property
    def about(self) -> dict[str, Any]:
        """The header's rank, pid, host and main thread ({} if it has none)."""
        return parse_header(self.header)

    def threads(self) -> list[frames.Thread]:
        """Every thread's latest stack, the main thread first (named "MainThread")."""
        return frames.parse_faulthandler(self.text, self.about.get("main"))


def _status_mask(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)
    return 0


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): it would handle a signal only once continued."""
    try:
        return process_tree.stat(pid)[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def has_handler(pid: int, signum: int) -> bool:
    """Whether process ``pid`` catches ``signum`` (a signal it does not catch may end it)."""
    try:
        return bool(signum) and bool(_status_mask(pid, "SigCgt") >> (signum - 1) & 1)
    except (OSError, ValueError):
        return False


def stacks_file(pid: int) -> str | None:
    """The stacks file process ``pid`` holds open, if any (this user's processes only)."""
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for n in names:
        with contextlib.suppress(OSError):
            target = os.readlink(f"{folder}/{n}")
            if target.startswith("/") and os.path.basename(os.path.dirname(target)) == FOLDER and \
                    _NAME.fullmatch(os.path.basename(target)):
                return target
    return None


def _read_from(where: str, offset: int, cap: int) -> tuple[bytes, int]:
    """Up to ``cap`` bytes of ``where`` from ``offset``, and its size: as untrusted input."""
    fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise OSError(f"{where} is not a regular file of this user's")
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, cap), st.st_size
    finally:
        os.close(fd)


def request(pid: int, signum: int, timeout: float, cap: int) -> Written | None:
    """Send ``signum`` to process ``pid`` (only if it has the handler) and
    read what its handler writes (at most ``cap`` bytes, within
    ``timeout`` seconds); None if it has no handler or no stacks file, or
    wrote nothing in time."""
    where = stacks_file(pid)
    if where is None or not has_handler(pid, signum) or _stopped(pid):
        return None
    try:
        head, size = _read_from(where, 0, 512)
        os.kill(pid, signum)
    except OSError:
        return None
    deadline = time.monotonic() + timeout
    seen, stable_since = size, time.monotonic()
    while time.monotonic() < deadline:  # the handler writes in a few ms; done once the size stops growing
        time.sleep(0.02)
        try:
            now_size = os.stat(where).st_size
        except OSError:
            return None
        if now_size != seen:
            seen, stable_since = now_size, time.monotonic()
        elif seen > size and time.monotonic() - stable_since >= 0.1:
            break
    if seen <= size:
        return None
    try:
        text, _ = _read_from(where, size, min(cap, seen - size))
    except OSError:
        return None
    return Written(where, head.split(b"\n", 1)[0].decode("utf-8", "replace"), text.decode("utf-8", "replace"))


K = TypeVar("K")


def request_all(pids: Mapping[K, int], signum: int, timeout: float, cap: int) -> dict[K, Written | None]:
    """``request`` of several processes at once: {key: what process ``pids[key]`` wrote, or None}."""
    if not pids:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(pids))) as pool:
        found = pool.map(lambda pid: request(pid, signum, timeout, cap), pids.values())
        return dict(zip(pids, found, strict=True))


def find(dump_dir: str) -> dict[int, list[str]]:
    """The stacks files of the ranks whose dump folder is ``dump_dir``:
    {rank: paths, the newest first}; {} where there are none (or the folder
    is a link: not followed)."""
    folder = os.path.join(dump_dir, FOLDER)
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return {}
        names = os.listdir(folder)
    except OSError:
        return {}
    out: dict[int, list[tuple[float, str]]] = {}
    for n in names:
        m = _NAME.fullmatch(n)
        if m is not None:
            p = os.path.join(folder, n)
            with contextlib.suppress(OSError):
                out.setdefault(int(m.group(1)), []).append((os.lstat(p).st_mtime, p))
    return {r: [p for _, p in sorted(found, reverse=True)] for r, found in sorted(out.items())}


def read(where: str, cap: int = MAX_BYTES) -> Written:
    """A stacks file, read as untrusted input (``dump.read_bytes``: no link
    followed, this user's regular file, at most ``cap`` bytes); NotADump
    saying why not, also when its header is not one or names another rank
    than its file name."""
    raw = dump.read_bytes(where, cap).decode("utf-8", "replace")
    first, _, text = raw.partition("\n")
    about, named = parse_header(first), _NAME.fullmatch(os.path.basename(where))
    if not about:
        raise NotADump("its first line is not a stacks file's header")
    if named is not None and (about["rank"], about["pid"]) != (int(named.group(1)), int(named.group(2))):
        raise NotADump(f"its header says rank {about['rank']}, pid {about['pid']}, unlike its name")
    return Written(where, first, text)


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read(1 << 20)
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep and k in (b"RANK", b"MASTER_PORT", b"MASTER_ADDR"):
            out[k.decode()] = v.decode("utf-8", "replace")
    return out


def find_ranks(addr: str, port: int, signum: int) -> dict[int, int]:
    """{rank: pid} of this user's processes on this host whose environment
    says they are rank RANK of the job whose store is at
    MASTER_ADDR:MASTER_PORT = ``addr``:``port`` and that catch ``signum``
    (children inherit both: the topmost is the rank)."""
    found: dict[int, list[tuple[int, int]]] = {}
    me = os.getuid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != me:
                continue
            e = _environ(pid)
            if (e.get("MASTER_PORT") != str(port) or e.get("MASTER_ADDR") != addr or not e.get("RANK", "").isdigit()
                    or not has_handler(pid, signum)):
                continue
            ppid = int(process_tree.stat(pid)[1])
        except (OSError, ValueError):
            continue
        found.setdefault(int(e["RANK"]), []).append((pid, ppid))
    out = {}
    for rank, procs in found.items():
        pids = {p for p, _ in procs}
        top = [p for p, pp in procs if pp not in pids]
        if len(top) == 1:
            out[rank] = top[0]
    return out
