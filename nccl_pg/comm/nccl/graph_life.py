"""Whether a CUDA graph is gone, without a Python callback: a CUDA user
object owned by the graph whose destructor is libc's ``sem_post`` on a
semaphore of ours (Programming Guide, "CUDA User Objects": the destructor runs
once the graph and all its instantiations are destroyed, "executed by a shared
internal thread", and "cannot make CUDA API calls and should avoid blocking
behavior"). ``sem_post`` takes the semaphore's address as its one argument, as
a ``cudaHostFn_t`` does, and its int result is dropped. The semaphore's
memory stays allocated until the post was seen (a graph may outlive whoever
watched it: freeing it earlier would let the destructor write freed memory).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from ._lib import check_cuda, cudart

_SEM_BYTES = 64  # sizeof(sem_t) is 32 on x86-64 and aarch64 glibc
_libc: Any = None
_alive: dict[int, Any] = {}  # address -> semaphore whose graph may still be alive
_lock = threading.Lock()


def _c() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def attach(graph: Any) -> Callable[[], bool]:
    """A probe of ``graph`` (being captured): True once it and its instantiations were destroyed."""
    libc = _c()
    sem = ctypes.create_string_buffer(_SEM_BYTES)
    if libc.sem_init(sem, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "sem_init failed")
    rt = cudart()
    post = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
    obj = check_cuda(rt.cudaUserObjectCreate(ctypes.addressof(sem), rt.cudaHostFn_t(init_value=post), 1,
                                             rt.cudaUserObjectFlags.cudaUserObjectNoDestructorSync),
                     "cudaUserObjectCreate")
    check_cuda(rt.cudaGraphRetainUserObject(graph, obj, 1, rt.cudaUserObjectRetainFlags.cudaGraphUserObjectMove),
               "cudaGraphRetainUserObject")
    with _lock:
        _alive[ctypes.addressof(sem)] = sem

    def gone() -> bool:
        value = ctypes.c_int(0)
        libc.sem_getvalue(sem, ctypes.byref(value))
        if value.value > 0:
            with _lock:
                _alive.pop(ctypes.addressof(sem), None)
            return True
        return False

    return gone
