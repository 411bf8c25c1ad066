"""Stacks when Python cannot answer: C-level dumps of every thread's Python
stack (``faulthandler``), which work while a thread holds the GIL or is
stuck in C, where the diagnosis threads (Python) cannot run.

In each rank (``CStacks``, driven by the watchdog): a file
``<dump dir>/c_stacks/rank<rank>.<pid>.txt`` (0600, in a 0700 folder, a
header line naming the rank, pid and main thread; removed at exit if
nothing was written to it), to which faulthandler appends

- on a signal (``NCCL_PG_STACKS_SIGNAL``, SIGUSR2 by default): a C-level
  handler, which ``nccl-pg why`` and ``nccl-pg run`` send to a rank on their
  host that does not answer an incident (``request``);
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

For the readers (``request``, ``find_ranks``, ``parse``): which local
processes are the ranks of a job (``MASTER_PORT`` and ``RANK`` in their
environment, this user's only), whether a process has the handler (its
``SigCgt`` mask: a signal without one would kill it), the file it writes to
(its open descriptors), and the dump read back as untrusted input (no link
followed, this user's regular file, at most ``cap`` bytes).
"""

from __future__ import annotations

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
from typing import IO, Any

from . import dump

log = logging.getLogger(__name__)

FOLDER = "c_stacks"  # beside the dumps; its file names hold no dump prefix (torch's analyzer reads every file that does)
SUFFIX = ".txt"
HEADER = "# nccl_pg C-level stacks: "
# The timer fires this long after the earliest deadline (the diagnosis's budget and reading time are at most 4 s).
TIMER_MARGIN = 5.0
# The timer is moved when it would expire within this many polls (or a second) of now.
_REARM_POLLS = 2
_REARM_MIN = 1.0


class CStacks:
    """This process's C-level stack dumps (see the module's docstring)."""

    def __init__(self, signum: int, interval: float) -> None:
        self.signum = signum
        self.window = max(_REARM_POLLS * interval, _REARM_MIN)
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
            folder = os.path.join(os.path.dirname(dump.path_for(rank)) or ".", FOLDER)
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise OSError(f"{folder} is not a directory of this user's")
            path = os.path.join(folder, f"rank{rank}.{os.getpid()}{SUFFIX}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                os.close(fd)
                raise OSError(f"{path} is not a regular file of this user's")
            f = os.fdopen(fd, "w")
            header = (f"{HEADER}rank {rank}, pid {os.getpid()}, host {socket.gethostname()}, main thread "
                      f"0x{threading.main_thread().ident or 0:016x}\n")
            f.write(header)
            f.flush()
            self._header = len(header.encode())
        except OSError as exc:
            log.warning("nccl_pg: no C-level stack dumps for rank %d: %s", rank, exc)
            self._failed = True
            return False
        self.file, self.path = f, path
        if self.signum:
            previous = signal.getsignal(self.signum)
            # chain to a handler someone installed (None: one installed from C), never to the default action,
            # which would end the process
            chain = previous not in (signal.SIG_DFL, signal.SIG_IGN)
            faulthandler.register(self.signum, file=f, all_threads=True, chain=chain)
        return True

    def keep(self, deadline: float | None) -> None:
        """The poller's move: ``deadline`` is the earliest deadline of the
        operations pending now (time.monotonic()), None when none is."""
        if self.file is None:
            return
        if deadline is not None:
            deadline += TIMER_MARGIN
        now = time.monotonic()
        if self.armed is not None and self.armed <= now:  # it fired (or was about to): not armed any more
            self.fired, self.armed = max(self.fired, self.armed), None
        if deadline is None or deadline <= self.fired:
            if self.armed is not None and self.armed - now < self.window:
                faulthandler.cancel_dump_traceback_later()
                self.armed = None
            return
        if self.armed is not None and self.armed <= deadline and self.armed - now >= self.window:
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
        file nothing was written to (but its header) goes."""
        self.cancel()
        if self.file is None or self.path is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self.file.fileno()).st_size <= self._header:
                os.unlink(self.path)
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(self.path))  # the last rank's file of the folder


# --- readers --------------------------------------------------------------------------------------


def _status_mask(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)
    return 0


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
                    target.endswith(SUFFIX):
                return target
    return None


def _read_from(path: str, offset: int, cap: int) -> tuple[bytes, int]:
    """Up to ``cap`` bytes of ``path`` from ``offset``, and its size: as untrusted input."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise OSError(f"{path} is not a regular file of this user's")
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, cap), st.st_size
    finally:
        os.close(fd)


def request(pid: int, signum: int, timeout: float, cap: int) -> dict[str, Any] | None:
    """Send ``signum`` to process ``pid`` (only if it has the handler) and
    read what its handler writes (at most ``cap`` bytes, within
    ``timeout`` seconds): {"path", "text", "header"}; None if it has no
    handler or no stacks file, or wrote nothing in time."""
    path = stacks_file(pid)
    if path is None or not has_handler(pid, signum):
        return None
    try:
        head, size = _read_from(path, 0, 512)
        os.kill(pid, signum)
    except OSError:
        return None
    deadline = time.monotonic() + timeout
    seen, stable_since = size, time.monotonic()
    while time.monotonic() < deadline:  # the handler writes in a few ms; done once the size stops growing
        time.sleep(0.02)
        try:
            now_size = os.stat(path).st_size
        except OSError:
            return None
        if now_size != seen:
            seen, stable_since = now_size, time.monotonic()
        elif seen > size and time.monotonic() - stable_since >= 0.1:
            break
    if seen <= size:
        return None
    try:
        text, _ = _read_from(path, size, min(cap, seen - size))
    except OSError:
        return None
    return {"path": path, "text": text.decode("utf-8", "replace"),
            "header": head.split(b"\n", 1)[0].decode("utf-8", "replace")}


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_MAIN = re.compile(r"main thread (0x[0-9a-fA-F]+)")


def parse(text: str, header: str = "") -> list[dict[str, Any]]:
    """Threads of a faulthandler dump, the main thread first when the
    header names it: [{"ident", "current", "main", "frames": [[file, line,
    function, ""], ...] outermost first}]."""
    main = _MAIN.search(header)
    main_ident = int(main.group(1), 16) if main else None
    threads: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            ident = int(m.group(2), 16)
            threads.append({"ident": ident, "current": m.group(1) == "Current thread", "main": ident == main_ident,
                            "frames": []})
            continue
        f = _FRAME.match(line)
        if f and threads:
            threads[-1]["frames"].insert(0, [f.group(1), int(f.group(2)), f.group(3), ""])
    threads.sort(key=lambda t: not t["main"])
    return threads


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
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
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
