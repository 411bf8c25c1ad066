"""Each rank's first program under `nccl-pg run`: ties the rank to the
launcher's life, then replaces itself with the rank's real command.

Done here rather than in a Popen preexec_fn because the launcher runs the
store server in a thread, and code between fork and exec in a threaded
process is unsafe. PR_SET_PDEATHSIG survives execve, so if the launcher is
killed outright (SIGKILL, OOM killer) the kernel kills the rank too, instead
of leaving it running and holding its GPU.

    python -m nccl_pg._rank_guard LAUNCHER_PID command [args...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    launcher, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"nccl-pg run: cannot tie rank to the launcher: {os.strerror(err)}", file=sys.stderr)
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        sys.exit("nccl-pg run: the launcher exited before this rank started")
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
