"""simnccl: NCCL and the CUDA runtime/driver simulated, so that nccl_pg's
NCCL backend runs in CI without a GPU.

NCCL is reached through the REAL nccl4py 0.6.0 binding (``nccl.bindings.nccl``)
over a stub libnccl.so.2 (stub/libnccl_stub.c, built with ``cc`` on first use
and cached): nccl4py's own argument conversion and result handling run on every
call the backend makes, and abi.py answers the C calls from the simulation
(ncclsim.py). How nccl4py is made to load the stub: it binds libnccl at its
first call, looking each function up in the process's global scope first
(``dlsym(RTLD_DEFAULT, ...)``) and loading a library through cuda.pathfinder
only for what it does not find there, after pathfinder's own check for a
libnccl.so.2 already loaded; so the stub, loaded by absolute path with
RTLD_GLOBAL before that first call (``install()``/``preload()``), is what it
binds, in every process that installs the simulation (forked ranks inherit it,
spawned ones load it from the cache). Details in stublib.py. The CUDA runtime
and driver are Python stand-ins (cudart.py) with the real bindings' types.

It proves our logic against NCCL's documented and implemented behaviour and
CUDA's documented rules (each rule cites its source in ncclsim.py and
cudart.py). It is never evidence of GPU behaviour: kernels are numpy, the
transport is TCP between processes, timings mean nothing.

Use::

    import simnccl
    simnccl.install()            # in every process that plays ranks
    simnccl.select_device(1)     # what torch.cuda.set_device(...) does for a real rank
    ...                          # nccl_pg with backend "nccl"; arrays from simnccl.xp
    assert simnccl.violations() == []
    simnccl.uninstall()

``start_world1()`` starts a one-rank world in this process (for benchmarks).
"""

from __future__ import annotations

import sys
from typing import Any

from . import abi, cudart, ncclsim, stublib, xp

SIM_VERSION = 23203  # NCCL 2.32.3: what nccl4py 0.6.0 was generated for, and the pin (tools/pins) installs


def install(devices: int = 2, version: int = SIM_VERSION) -> None:
    """Route nccl_pg's NCCL backend to the simulation in this process
    (``devices`` simulated GPUs; ``version`` what ncclGetVersion says). The
    simulated state lives as long as the process: installing again after
    ``uninstall()`` resumes it (threads keep their device and capture mode,
    as they would with one CUDA runtime)."""
    from nccl_pg.comm import backends  # noqa: PLC0415
    from nccl_pg.comm.nccl import _lib  # noqa: PLC0415

    global _modules
    preload()
    if cudart.SIM is None:
        s = cudart.install(devices)
        ncclsim.install(version, s.violations)
        _modules = cudart.modules()
    ncclsim.world().version = version
    abi.install()
    _lib.use_modules(None, *_modules)  # NCCL: the real binding, now over the stub
    sys.modules["cupy"] = xp  # type: ignore[assignment]
    backends.gpu_count.cache_clear()


_modules: tuple[Any, Any] = (None, None)


def preload() -> None:
    """Load the stub libnccl.so.2 (building it if needed) before anything calls NCCL in this process; until
    ``install()`` it passes calls on to the real libnccl. Raises StubBuildError if ``cc`` fails."""
    stublib.load()


def uninstall() -> None:
    """Give nccl_pg the real CUDA bindings back and let the stub pass NCCL calls on to the real libnccl (the
    simulated state stays for a later ``install()``)."""
    from nccl_pg.comm import backends  # noqa: PLC0415
    from nccl_pg.comm.nccl import _lib  # noqa: PLC0415

    abi.uninstall()
    _lib.use_modules()
    if sys.modules.get("cupy") is xp:
        del sys.modules["cupy"]
    backends.gpu_count.cache_clear()


def installed() -> bool:
    from nccl_pg.comm.nccl import _lib  # noqa: PLC0415

    return cudart.SIM is not None and _lib.cudart() is _modules[0]


def select_device(device: int) -> None:
    """cudaSetDevice on the calling thread."""
    err, = cudart.cudaSetDevice(device)
    if int(err):
        raise RuntimeError(f"cudaSetDevice({device}): {err}")


def violations() -> list[str]:
    """Every misuse recorded since the last ``clear()``: CUDA/NCCL rules broken, races, contexts on devices
    this process does not use."""
    s = cudart.sim()
    return list(s.violations.items) + s.context_violations()


def clear() -> None:
    """Forget the violations recorded so far (between tests)."""
    cudart.sim().clear()


def set_version(version: int) -> None:
    """What ncclGetVersion says from now on (nccl_pg reads it again)."""
    from nccl_pg.comm.nccl import _lib  # noqa: PLC0415

    ncclsim.world().version = version
    _lib.version.cache_clear()


def fail_next(call: str, result: int) -> None:
    """Fault injection: the next async job of ``call`` (e.g. "ncclCommShrink") ends with ``result``."""
    ncclsim.world().fail[call] = result


def fail_call(call: str, result: int) -> None:
    """Fault injection: the next ``call`` (e.g. "ncclCommRevoke") returns ``result`` at once."""
    ncclsim.world().fail_call[call] = result


def slow(call: str, seconds: float) -> None:
    """Stay ``seconds`` inside every ``call`` (widens race windows deterministically); 0 undoes it."""
    w = ncclsim.world()
    if seconds:
        w.delay[call] = seconds
    else:
        w.delay.pop(call, None)


def counters() -> dict[str, Any]:
    """NCCL and CUDA calls made so far, and helper threads the simulated NCCL started."""
    w, s = ncclsim.world(), cudart.sim()
    return {"nccl": dict(w.calls), "cuda": dict(s.calls), "threads": w.threads_started}


def call_log() -> list[tuple[str, dict[str, Any]]]:
    """The communicator lifecycle calls made so far (init, split, shrink, revoke, ncclCommGetUniqueId,
    ncclCommGrow, finalize, destroy, abort), in order, each with what identifies it ("comm": the handle it was
    made on, 0 for NULL; shrink's "flags"; grow's "nranks", "rank", "id": whether an id was passed)."""
    return list(ncclsim.world().log)


def live_communicators() -> int:
    return len(ncclsim.world().comms)


def start_world1(device: int = 0, **init_kwargs: Any) -> Any:
    """A one-rank nccl_pg world on the simulated NCCL backend in this process
    (installs the simulation if needed); returns the default ProcessGroup.
    Stop it with ``stop_world1()``."""
    import nccl_pg as dist  # noqa: PLC0415
    from nccl_pg.store import HashStore  # noqa: PLC0415

    if not installed():
        install()
    select_device(device)
    dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, device_id=device, **init_kwargs)
    return dist.distributed._get_default_group()


def stop_world1() -> None:
    import nccl_pg as dist  # noqa: PLC0415

    if dist.is_initialized():
        dist.destroy_process_group()
    uninstall()
