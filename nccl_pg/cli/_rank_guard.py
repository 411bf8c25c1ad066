"""Each rank's first program under `nccl-pg run`: ties the rank and
everything it starts to the launcher's life.

    python -m nccl_pg.cli._rank_guard LAUNCHER_PID command [args...]

The guard stays as the rank's parent: a small process that forks the rank's
command and waits. It is done here rather than in a Popen preexec_fn because
the launcher runs the store server in a thread, and code between fork and
exec in a threaded process is unsafe.

- If the launcher is killed outright (SIGKILL, OOM killer) the kernel sends
  the guard its parent-death signal (PR_SET_PDEATHSIG); the guard then kills
  the rank and every process below it, including those that left the rank's
  process group or session (the guard is their subreaper,
  PR_SET_CHILD_SUBREAPER, so orphans come back to it instead of init). The
  rank itself dies with the guard in any case (its own parent-death signal).
- When the rank exits, the guard kills what the rank left behind, then exits
  the way the rank did (same code, or same signal), so the launcher sees the
  rank's status.
- Signals: the launcher signals the rank's whole process group, which
  reaches the rank directly; the guard passes on only what someone sends to
  it alone.
- Killing: the launcher never SIGKILLs the guard while it is alive (that
  would orphan what the rank started outside its process group, with no
  subreaper left). It sends the guard ``KILL_SIGNAL``; the guard SIGKILLs
  the rank and every process below it, then exits as the rank did.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
from collections.abc import Callable

from .. import process_tree

KILL_SIGNAL = signal.SIGUSR1  # from the launcher: kill the rank and all below it now
_WATCHED = {signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, KILL_SIGNAL}
CLEANUP_BUDGET = 5.0  # seconds to kill and reap every descendant


def _check(failed: str | None, what: str) -> None:
    if failed is not None:
        print(f"nccl-pg run: cannot {what}: {failed}", file=sys.stderr, flush=True)


def _collector(rank: int, status: list[int]) -> Callable[[int, int], None]:
    """A ``reap`` callback that keeps the rank's wait status in ``status``."""
    def on_exit(pid: int, code: int) -> None:
        if pid == rank:
            status.append(code)
    return on_exit


def _exit_like(status: int) -> None:
    """End this process as the rank ended: its exit code, or its signal."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        os._exit(code)
    sig = -code
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank has dumped its core, if any
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def _supervise(rank: int, launcher: int) -> None:
    status: list[int] = []
    on_exit = _collector(rank, status)
    while True:
        info = signal.sigwaitinfo(_WATCHED)
        if info.si_signo == signal.SIGCHLD:
            process_tree.reap(on_exit)
            if status:
                process_tree.end_descendants(CLEANUP_BUDGET, on_exit)
                _exit_like(status[0])
            continue
        if os.getppid() != launcher:  # our parent-death signal: the launcher is gone
            process_tree.end_descendants(CLEANUP_BUDGET, on_exit)
            os._exit(128 + signal.SIGKILL)
        if info.si_signo == KILL_SIGNAL and info.si_pid == launcher:
            process_tree.end_descendants(CLEANUP_BUDGET, on_exit)
            _exit_like(status[0] if status else signal.SIGKILL)  # a status: killed by SIGKILL
        if info.si_pid != launcher:  # sent to the guard alone: it was meant for the rank
            try:
                os.kill(rank, info.si_signo)
            except ProcessLookupError:
                pass


def main(argv: list[str]) -> None:
    launcher, command = int(argv[0]), argv[1:]
    _check(process_tree.die_with_parent(signal.SIGTERM), "tie the rank to the launcher")
    _check(process_tree.adopt_orphans(), "adopt the rank's orphans")
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        sys.exit("nccl-pg run: the launcher exited before this rank started")
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)  # before the fork: none is lost
    guard = os.getpid()
    rank = os.fork()
    if rank == 0:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            _check(process_tree.die_with_parent(signal.SIGKILL), "tie the rank to its guard")
            if os.getppid() != guard:
                os._exit(1)
            os.execv(command[0], command)
        except BaseException as exc:
            print(f"nccl-pg run: cannot start {command[0]}: {exc}", file=sys.stderr, flush=True)
        os._exit(127)
    _supervise(rank, launcher)


if __name__ == "__main__":
    main(sys.argv[1:])
