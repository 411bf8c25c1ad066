"""Fork safety: nccl_pg's objects act only in the process that created them.

A child forked after init (a data loader, a ``multiprocessing`` worker, a
plain ``os.fork``) inherits every object and every registered exit handler,
and shares the parent's sockets and files. If the child's exit aborted the
inherited communicators (``ProcessGroup.__del__``, the exit handlers), the
shutdown of the shared sockets would break the parent's groups, and the
child would unlink the parent's dump pipe. So an object remembers the pid
that made it (``Owner``), and its finalizer and the exit handlers act only
on objects made in the process they run in (a process forked before it made
its own groups still cleans those up at its exit).
"""

from __future__ import annotations

import os


class Owner:
    """The process that created an object; ``here()`` is False in a forked child."""

    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()

    def here(self) -> bool:
        return os.getpid() == self.pid
