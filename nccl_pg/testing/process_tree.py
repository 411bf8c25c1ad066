"""A rank's processes, so that none outlives its test: a rank runs in a
process group (session) of its own and is its descendants' subreaper (an
orphaned grandchild is re-parented to the rank, not to init, so it stays in
the rank's tree); the rank kills its descendants when it ends, and the
harness kills the rank's process group and every descendant it can find
when it ends the rank. Linux gives all three means; elsewhere only the
process group is used."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

_LINUX = sys.platform.startswith("linux")
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36  # <linux/prctl.h>


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent(parent: int) -> None:
    """This process ends (SIGKILL) when ``parent`` does, even when the parent
    is killed outright (a CI timeout): a rank must not hold its CPU, GPU and
    ports after the harness is gone. Linux only."""
    if _LINUX:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def adopt_orphans() -> None:
    """Make this process the subreaper of its descendants (Linux >= 3.4)."""
    if _LINUX:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc (processes that end meanwhile are skipped)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            out[int(name)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first), from /proc; [] where
    there is no /proc."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def kill(pids: list[int]) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group (the rank's session: its members,
    whoever their parent now is) and every descendant of ``pid``, also those
    that left the group. ``pid`` must not have been reaped yet (a zombie is
    fine: it keeps its number from reuse)."""
    below = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    kill(below)
    kill(descendants(pid))  # any forked while the first round was sent


def end_descendants(within: float = 1.0) -> list[int]:
    """Kill this process's descendants and reap its children (a subreaper's
    children include its orphaned grandchildren); returns those killed."""
    me, killed = os.getpid(), []
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:  # a child may fork while it is being killed
        below = [p for p in descendants(me) if alive(p)]
        reap()
        if not below:
            break
        killed += [p for p in below if p not in killed]
        kill(below)
        time.sleep(0.01)
    reap()
    return killed


def reap() -> None:
    """Reap every ended child of this process, without waiting for the living."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2:][:1] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
