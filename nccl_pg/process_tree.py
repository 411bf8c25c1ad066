"""A process's tree, so that nothing it started outlives it: the means shared
by the launcher's rank guard (cli/_rank_guard.py) and the test harness's
rank processes (testing/rank_main.py, testing/processes.py).

- Linux's prctl: die with one's parent (PR_SET_PDEATHSIG), and be the
  subreaper of one's descendants (PR_SET_CHILD_SUBREAPER: an orphaned
  grandchild is re-parented to us, not to init, so it stays in our tree);
- the tree read from /proc (``descendants``; a zombie is not alive);
- ending it: ``end_descendants`` (from inside: kill every descendant and
  reap, until none is left, as new orphans come back to a subreaper while
  it works), ``kill_tree`` (from outside: a process's group and every
  descendant found).

Elsewhere than Linux there is no prctl and no /proc: only process groups
work. Base layer: imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable

LINUX = sys.platform.startswith("linux")
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # <linux/prctl.h>


def _prctl(option: int, value: int) -> str | None:
    """None, or why the call failed."""
    if not LINUX:
        return "not Linux"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def die_with_parent(signum: int = signal.SIGKILL) -> str | None:
    """This process gets ``signum`` when its parent ends, even when the
    parent is killed outright; None, or why not. The caller must then check
    that its parent is still the one it expects (it may have died first)."""
    return _prctl(PR_SET_PDEATHSIG, signum)


def adopt_orphans() -> str | None:
    """Make this process the subreaper of its descendants (Linux >= 3.4); None, or why not."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def stat(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after "pid (comm)" (comm may hold spaces
    and parentheses): [state, ppid, ...], stat's field n at index n - 3."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return raw[raw.rfind(b")") + 2:].decode("ascii", "replace").split()


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (children first), from /proc; [] where
    there is no /proc."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = stat(name)
        except OSError:  # ended meanwhile
            continue
        if len(fields) > 1 and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def only_child(pid: int) -> int | None:
    """The one child of ``pid`` (a rank's guard has one: the rank), from /proc; None if it has none or several."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
    except OSError:
        kids = [str(p) for p in descendants(pid) if stat(p)[1:2] == [str(pid)]] if os.path.isdir("/proc") else []
    return int(kids[0]) if len(kids) == 1 else None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        return stat(pid)[:1] != ["Z"]
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def kill(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids`` (those already gone, or not ours, are skipped)."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def tagged(name: str, value: str) -> list[int]:
    """This user's processes whose environment holds ``name=value`` (read
    from /proc/<pid>/environ: what they started with, which their children
    inherit); [] where there is no /proc."""
    if not os.path.isdir("/proc"):
        return []
    want, me, out = f"{name}={value}".encode(), os.getuid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry}").st_uid != me:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if want in f.read(1 << 20).split(b"\0"):
                    out.append(int(entry))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group (a rank's session: its members,
    whoever their parent now is) and every descendant of ``pid``, also those
    that left the group. ``pid`` must not have been reaped yet (a zombie is
    fine: it keeps its number from reuse)."""
    below = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    kill(below)
    kill(descendants(pid))  # any forked while the first round was sent


def reap(on_exit: Callable[[int, int], None] | None = None) -> None:
    """Reap every ended child of this process, without waiting for the
    living; ``on_exit(pid, wait status)`` for each."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if on_exit is not None:
            on_exit(pid, status)


def end_descendants(within: float, on_exit: Callable[[int, int], None] | None = None) -> list[int]:
    """Kill this process's descendants and reap its children (a subreaper's
    children include its orphaned grandchildren) until none is left, for at
    most ``within`` seconds; returns those killed (``on_exit``: ``reap``'s)."""
    me, killed = os.getpid(), []
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:  # a child may fork, or an orphan come back, while they are killed
        below = descendants(me)
        reap(on_exit)
        if not below:
            break
        killed += [p for p in below if p not in killed]
        kill(below)
        time.sleep(0.005)
    reap(on_exit)
    return killed
