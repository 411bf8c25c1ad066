"""The binding layer of the NCCL simulation, and the simulated rules seen
through it.

CI runs nccl_pg's NCCL backend through the real nccl4py 0.6.0 binding over a
stub libnccl.so.2 (tests/simnccl/stub, stublib.py) whose calls abi.py answers
from the simulation. Checked here: nccl4py binds the stub (never NVIDIA's
library, in spawned and forked processes too); the stub has every function
nccl4py looks up, with nccl.h's signatures; what nccl4py passes for every call
the backend makes reaches the simulation intact (ids, configs, counts, streams,
pointers as exact ints), and what the simulation answers comes back through
nccl4py as it would from NCCL (results, out-parameters, NCCLError codes, other
exceptions). Then the simulation's CUDA and NCCL rules on small cases, each
against the rule its docstring cites. None of this is about GPU behaviour.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import nccl.bindings._internal.nccl as loader  # type: ignore[import-untyped]
import nccl.bindings.nccl as real  # type: ignore[import-untyped]
import numpy as np
import pytest
import simnccl
from cuda.pathfinder import find_nvidia_header_directory  # type: ignore[import-untyped]
from nccl.bindings._internal.utils import FunctionNotFoundError  # type: ignore[import-untyped]
from simnccl import abi, cudart, ncclsim, stublib

pytestmark = [pytest.mark.simnccl, pytest.mark.timeout(120), pytest.mark.usefixtures("simnccl_installed")]

TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def _clean():
    simnccl.clear()
    yield
    simnccl.clear()


def _driver_present() -> bool:
    from cuda.bindings import runtime  # type: ignore[import-untyped]

    return int(runtime.cudaGetDeviceCount()[0]) == 0


def _mapped_libnccl() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({ln.split()[-1] for ln in f if os.path.basename(ln.split()[-1]).startswith("libnccl.so")})


# --- loading ----------------------------------------------------------------------------------------------

def test_nccl4py_binds_the_stub_in_a_new_process_never_nvidias_library() -> None:
    """A spawned rank: install() loads the stub before nccl4py's first call, and nccl4py binds it (the version is
    the simulation's, not libnccl 2.32.3's); NVIDIA's library is never even mapped."""
    code = ("import simnccl, nccl.bindings.nccl as b\n"
            "simnccl.install(version=22805)\n"
            "print(b.get_version()); print(b.get_library_path())\n"
            "print('|'.join(sorted({l.split()[-1] for l in open('/proc/self/maps') if '/libnccl.so' in l})))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    version, path, mapped = out.stdout.splitlines()
    stub = str(stublib.build())
    assert version == "22805"
    assert os.path.samefile(path, stub)
    assert [os.path.realpath(p) for p in mapped.split("|")] == [os.path.realpath(stub)]


def test_a_forked_process_keeps_the_stub() -> None:
    """A forked rank inherits the stub and the simulation behind it."""
    simnccl.set_version(22904)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.write(w, f"{real.get_version()} {real.get_library_path()}".encode())
            finally:
                os._exit(0)
        os.close(w)
        ready, _, _ = select.select([r], [], [], 30)
        data = os.read(r, 4096).decode() if ready else ""
        os.close(r)
        if not ready:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    finally:
        simnccl.set_version(simnccl.SIM_VERSION)
    version, path = data.split()
    assert version == "22904" and os.path.samefile(path, stublib.build())


def test_the_stub_defines_every_function_nccl4py_looks_up() -> None:
    """nccl4py's loader (nccl/bindings/_internal) keeps one cached pointer per NCCL function it resolves; a name
    the stub lacks would make nccl4py load NVIDIA's library for it."""
    names = set(re.findall(rb"__pyx_v_4nccl_8bindings_9_internal_4nccl___(nccl[A-Z]\w+)", Path(loader.__file__).read_bytes()))
    assert len(names) >= 90, f"cannot read the functions nccl4py resolves from {loader.__file__}"
    lib = ctypes.CDLL(str(stublib.build()))
    missing = sorted(n.decode() for n in names if not hasattr(lib, n.decode()))
    assert missing == []


def _compile_against_nccl_h(tmp_path: Path, source: Path) -> subprocess.CompletedProcess[str]:
    """``cc -fsyntax-only`` of ``source`` with NCCL's own declarations (nccl.h of the installed nvidia-nccl wheel;
    a stand-in cuda_runtime.h gives it cudaStream_t)."""
    include = find_nvidia_header_directory("nccl")
    assert include is not None, "nccl.h not found: install the test-cu13 (or test-cu12) extra"
    header = (Path(include) / "nccl.h").read_text()
    code = re.search(r"#define NCCL_VERSION_CODE (\d+)", header)
    assert code and int(code.group(1)) == simnccl.SIM_VERSION, (
        f"the stub follows NCCL {nccl_versions()[1]}'s nccl.h (tools/pins/); {include} has version code "
        f"{code and code.group(1)}: install with the pins (`make install-test`)")
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "cuda_runtime.h").write_text("typedef struct CUstream_st *cudaStream_t;\n"
                                         "typedef struct CUevent_st *cudaEvent_t;\n")
    (shim / "cuda_fp16.h").write_text("")
    return subprocess.run(["cc", "-fsyntax-only", "-Wall", "-Werror", "-DSIMNCCL_CHECK_HEADER", f"-I{shim}",
                           f"-I{include}", str(source)], capture_output=True, text=True, timeout=60)


def nccl_versions() -> tuple[str, str]:
    """(installed, pinned): the installed nvidia-nccl wheel's version, and the one tools/pins/ pins for its CUDA
    major."""
    pins = Path(__file__).resolve().parent.parent / "tools" / "pins"
    for major in (13, 12):
        try:
            installed = metadata.version(f"nvidia-nccl-cu{major}")
        except metadata.PackageNotFoundError:
            continue
        pin = re.search(rf"^nvidia-nccl-cu{major}==(\S+)$", (pins / f"cu{major}.txt").read_text(), re.M)
        assert pin, f"tools/pins/cu{major}.txt pins no nvidia-nccl-cu{major}"
        return installed, pin.group(1)
    raise AssertionError("no nvidia-nccl wheel installed: install the test-cu13 (or test-cu12) extra")


def test_the_simulation_follows_the_pinned_nccl() -> None:
    """The pin, the stub's header check and the simulation's version move together (docs/TESTING.md, "Pinned
    versions"): a pin moved alone fails here, and an install without the pins is named as such."""
    installed, pinned = nccl_versions()
    major, minor, patch = (int(x) for x in pinned.split(".")[:3])
    assert simnccl.SIM_VERSION == major * 10000 + minor * 100 + patch, \
        f"tools/pins/ pins NCCL {pinned}; the simulation follows {simnccl.SIM_VERSION}"
    assert installed == pinned, f"NCCL {installed} is installed, not the pinned {pinned}: `make install-test`"


def test_the_stub_has_the_signatures_of_nccl_h(tmp_path: Path) -> None:
    """Compiled against nccl.h, a stub function whose signature differs from NCCL's is a conflicting declaration;
    the check itself bites (a copy with one parameter's type changed does not compile)."""
    ok = _compile_against_nccl_h(tmp_path, stublib.SOURCE)
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.c"
    text = stublib.SOURCE.read_text()
    assert "X(ncclGetVersion, (int *version), (version))" in text
    bad.write_text(text.replace("X(ncclGetVersion, (int *version), (version))",
                                "X(ncclGetVersion, (long *version), (version))"))
    wrong = _compile_against_nccl_h(tmp_path, bad)
    assert wrong.returncode != 0 and "conflicting types for 'ncclGetVersion'" in wrong.stderr.replace("‘", "'") \
        .replace("’", "'")


def test_the_stub_is_built_once_and_a_failed_build_is_an_error(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = stublib.build()
    before = path.stat().st_mtime_ns
    assert stublib.build() == path and path.stat().st_mtime_ns == before  # cached by source hash
    assert path.parent.parent == stublib.SOURCE.parent / "build"
    broken = tmp_path / "libnccl_stub.c"
    broken.write_text(stublib.SOURCE.read_text() + "\nthis is not C;\n")
    monkeypatch.setattr(stublib, "SOURCE", broken)
    with pytest.raises(stublib.StubBuildError, match="(?s)cc failed .*error: "):
        stublib.build()


def test_without_the_simulation_the_stub_passes_calls_to_nvidias_library() -> None:
    """uninstall(): nccl4py (bound to the stub for good) reaches the real libnccl; install(): the simulation again."""
    path = stublib.real_libnccl()
    assert path is not None, "no NVIDIA libnccl: install the test-cu13 (or test-cu12) extra"
    nvidia = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    version = ctypes.c_int()
    assert nvidia.ncclGetVersion(ctypes.byref(version)) == 0
    simnccl.set_version(22600)
    try:
        simnccl.uninstall()
        try:
            assert real.get_version() == version.value != 22600
        finally:
            simnccl.install(version=22600)
        assert real.get_version() == 22600
    finally:
        simnccl.set_version(simnccl.SIM_VERSION)


# --- what nccl4py passes reaches the simulation; what it answers comes back ---------------------------------

def _seen(value: Any) -> Any:
    """An argument as the simulation received it, comparable (a config is read while the call runs)."""
    if isinstance(value, real.Comm):
        return ("Comm", value.handle)
    if isinstance(value, real.Config) or (isinstance(value, int) and value in _CONFIGS):
        cfg = value if isinstance(value, real.Config) else real.Config.from_ptr(value)
        return ("Config", cfg.blocking, cfg.split_share, cfg.shrink_share, cfg.min_ctas, cfg.comm_name)
    if isinstance(value, int) and value in _COLL_CONFIGS:  # a ncclCollConfig_t*, read during the call
        c = real.CollConfig.from_ptr(value)
        return ("CollConfig", c.min_ctas, c.max_ctas, c.alg_selection, c.user_profiler_tag,
                c.launch_completion_event_handle)
    if isinstance(value, int) and value in _UIDS:
        return ("UniqueId", ctypes.string_at(value, 128))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, list):
        return [int(x) for x in value]
    return value


# The addresses of the configs made here; each config is kept (``_KEEP``) so that no other object, a config of the
# other kind above all, is ever made at an address in these sets (a freed Config's address reused by a CollConfig
# was read as a Config: a crash of the worker, once in a suite run).
_CONFIGS: set[int] = set()
_COLL_CONFIGS: set[int] = set()


def _coll_config() -> Any:
    c = real.CollConfig()
    c.min_ctas, c.max_ctas, c.alg_selection, c.user_profiler_tag = 2, 5, "ring+^ll", 2**40 + 3
    c.launch_completion_event_handle = 0x6600_0010
    _COLL_CONFIGS.add(c.ptr)
    _KEEP.append(c)
    return c


_KEEP: list[Any] = []
CC = ("CollConfig", 2, 5, "ring+^ll", 2**40 + 3, 0x6600_0010)


def _config(**fields: Any) -> Any:
    cfg = real.Config()
    for k, v in fields.items():
        setattr(cfg, k, v)
    _CONFIGS.add(cfg.ptr)
    _KEEP.append(cfg)
    return cfg


S, R, N, ST, H = 0x7F00_1234_5678, -0x1000, 2**33 + 5, 0x5555_0000_AAAA, 0x5100_0042  # pointers, count, stream, comm
PATTERN = bytes(range(128))
IDS = bytes((7 * i) % 256 for i in range(3 * 128))
CFG = dict(blocking=0, split_share=1, shrink_share=1, min_ctas=3, comm_name="ops-7")
SEEN_CFG = ("Config", 0, 1, 1, 3, "ops-7")


_UIDS: set[int] = set()  # the addresses of the ids made here, passed by address (comm_grow's unique_id)


def _uid(raw: bytes) -> Any:
    uid = real.UniqueId.from_buffer(bytearray(raw))
    _UIDS.add(uid.ptr)
    return uid


GROW_ID = _uid(PATTERN)  # a new rank's grow: nccl4py passes the id's address, the simulation reads it during the call

# (simulation function, the binding call as the backend makes it, the arguments the simulation must see,
#  what the simulation returns, a check of what the binding returned)
CASES: list[tuple[str, Callable[[], Any], tuple[Any, ...], Any, Callable[[Any], bool]]] = [
    ("all_reduce", lambda: real.all_reduce(S, R, N, 9, 4, real.Comm(H), ST), (S, R, N, 9, 4, ("Comm", H), ST),
     None, lambda r: r is None),
    ("reduce", lambda: real.reduce(S, R, N, 7, 2, 3, real.Comm(H), ST), (S, R, N, 7, 2, 3, ("Comm", H), ST),
     None, lambda r: r is None),
    ("broadcast", lambda: real.broadcast(S, R, N, 1, 2, real.Comm(H), ST), (S, R, N, 1, 2, ("Comm", H), ST),
     None, lambda r: r is None),
    ("reduce_scatter", lambda: real.reduce_scatter(S, R, N, 8, 0, real.Comm(H), ST), (S, R, N, 8, 0, ("Comm", H), ST),
     None, lambda r: r is None),
    ("all_gather", lambda: real.all_gather(S, R, N, 11, real.Comm(H), ST), (S, R, N, 11, ("Comm", H), ST),
     None, lambda r: r is None),
    ("allto_all", lambda: real.allto_all(S, R, N, 4, real.Comm(H), ST), (S, R, N, 4, ("Comm", H), ST),
     None, lambda r: r is None),
    ("gather", lambda: real.gather(S, R, N, 5, 1, real.Comm(H), ST), (S, R, N, 5, 1, ("Comm", H), ST),
     None, lambda r: r is None),
    ("scatter", lambda: real.scatter(S, R, N, 6, 1, real.Comm(H), ST), (S, R, N, 6, 1, ("Comm", H), ST),
     None, lambda r: r is None),
    ("send", lambda: real.send(S, N, 2, 5, real.Comm(H), ST), (S, N, 2, 5, ("Comm", H), ST), None, lambda r: r is None),
    ("recv", lambda: real.recv(R, N, 3, 6, real.Comm(H), ST), (R, N, 3, 6, ("Comm", H), ST), None, lambda r: r is None),
    ("group_start", real.group_start, (), None, lambda r: r is None),
    ("group_end", real.group_end, (), None, lambda r: r is None),
    ("get_version", real.get_version, (), 22905, lambda r: r == 22905),
    ("get_unique_id", real.get_unique_id, (), _uid(PATTERN), lambda r: ctypes.string_at(r.ptr, 128) == PATTERN),
    ("comm_init_rank_config", lambda: real.comm_init_rank_config(7, _uid(PATTERN), 3, _config(**CFG)),
     (7, PATTERN, 3, SEEN_CFG), real.Comm(0xC0FF_EE00), lambda r: r.handle == 0xC0FF_EE00),
    ("comm_init_rank_scalable", lambda: real.comm_init_rank_scalable(8, 5, 3, bytearray(IDS), _config(**CFG)),
     (8, 5, 3, IDS, SEEN_CFG), real.Comm(0xC0FF_EF00), lambda r: r.handle == 0xC0FF_EF00),
    ("comm_split", lambda: real.comm_split(real.Comm(H), 2, 9, _config(**CFG)), (("Comm", H), 2, 9, SEEN_CFG),
     real.Comm(0xBEEF_0100), lambda r: r.handle == 0xBEEF_0100),
    ("comm_shrink", lambda: real.comm_shrink(real.Comm(H), [3, 1, 7], 3, _config(**CFG), 1),
     (("Comm", H), [3, 1, 7], 3, SEEN_CFG, 1), real.Comm(0xBEEF_0200), lambda r: r.handle == 0xBEEF_0200),
    ("comm_get_unique_id", lambda: real.comm_get_unique_id(real.Comm(H)), (("Comm", H),), _uid(PATTERN),
     lambda r: ctypes.string_at(r.ptr, 128) == PATTERN),
    ("comm_grow", lambda: real.comm_grow(real.Comm(H), 9, 0, -1, _config(**CFG)), (("Comm", H), 9, 0, -1, SEEN_CFG),
     real.Comm(0xBEEF_0400), lambda r: r.handle == 0xBEEF_0400),
    ("comm_grow", lambda: real.comm_grow(real.Comm(0), 9, GROW_ID, 7, _config(**CFG)),
     (("Comm", 0), 9, ("UniqueId", PATTERN), 7, SEEN_CFG), real.Comm(0xBEEF_0500), lambda r: r.handle == 0xBEEF_0500),
    ("comm_get_async_error", lambda: real.comm_get_async_error(real.Comm(H)), (("Comm", H),), 6, lambda r: r == 6),
    ("comm_user_rank", lambda: real.comm_user_rank(real.Comm(H)), (("Comm", H),), 5, lambda r: r == 5),
    ("comm_count", lambda: real.comm_count(real.Comm(H)), (("Comm", H),), 17, lambda r: r == 17),
    ("comm_finalize", lambda: real.comm_finalize(real.Comm(H)), (("Comm", H),), None, lambda r: r is None),
    ("comm_destroy", lambda: real.comm_destroy(real.Comm(H)), (("Comm", H),), None, lambda r: r is None),
    ("comm_abort", lambda: real.comm_abort(real.Comm(H)), (("Comm", H),), None, lambda r: r is None),
    ("comm_revoke", lambda: real.comm_revoke(real.Comm(H), 0), (("Comm", H), 0), None, lambda r: r is None),
    ("red_op_create_pre_mul_sum", lambda: real.red_op_create_pre_mul_sum(S, 8, 1, real.Comm(H)),
     (S, 8, 1, ("Comm", H)), 4097, lambda r: r == 4097),
    ("red_op_destroy", lambda: real.red_op_destroy(4097, real.Comm(H)), (4097, ("Comm", H)), None, lambda r: r is None),
    ("all_reduce_config", lambda: real.all_reduce_config(S, R, N, 9, 4, real.Comm(H), ST, _coll_config()),
     (S, R, N, 9, 4, ("Comm", H), ST, CC), None, lambda r: r is None),
    ("reduce_config", lambda: real.reduce_config(S, R, N, 7, 2, 3, real.Comm(H), ST, _coll_config()),
     (S, R, N, 7, 2, 3, ("Comm", H), ST, CC), None, lambda r: r is None),
    ("broadcast_config", lambda: real.broadcast_config(S, R, N, 1, 2, real.Comm(H), ST, _coll_config()),
     (S, R, N, 1, 2, ("Comm", H), ST, CC), None, lambda r: r is None),
    ("reduce_scatter_config", lambda: real.reduce_scatter_config(S, R, N, 8, 0, real.Comm(H), ST, _coll_config()),
     (S, R, N, 8, 0, ("Comm", H), ST, CC), None, lambda r: r is None),
    ("all_gather_config", lambda: real.all_gather_config(S, R, N, 11, real.Comm(H), ST, _coll_config()),
     (S, R, N, 11, ("Comm", H), ST, CC), None, lambda r: r is None),
    ("allto_all_config", lambda: real.allto_all_config(S, R, N, 4, real.Comm(H), ST, _coll_config()),
     (S, R, N, 4, ("Comm", H), ST, CC), None, lambda r: r is None),
    ("gather_config", lambda: real.gather_config(S, R, N, 5, 1, real.Comm(H), ST, _coll_config()),
     (S, R, N, 5, 1, ("Comm", H), ST, CC), None, lambda r: r is None),
    ("scatter_config", lambda: real.scatter_config(S, R, N, 6, 1, real.Comm(H), ST, _coll_config()),
     (S, R, N, 6, 1, ("Comm", H), ST, CC), None, lambda r: r is None),
    ("comm_suspend", lambda: real.comm_suspend(real.Comm(H), 1), (("Comm", H), 1), None, lambda r: r is None),
    ("comm_resume", lambda: real.comm_resume(real.Comm(H)), (("Comm", H),), None, lambda r: r is None),
    ("comm_mem_stats", lambda: real.comm_mem_stats(real.Comm(H), 3), (("Comm", H), 3), 2**40 + 7,
     lambda r: r == 2**40 + 7),
]


def _spy(monkeypatch: pytest.MonkeyPatch, name: str, answer: Callable[[], Any]) -> list[tuple[Any, ...]]:
    seen: list[tuple[Any, ...]] = []

    def spy(*args: Any) -> Any:
        seen.append(tuple(_seen(a) for a in args))
        return answer()

    monkeypatch.setattr(abi.simulation(), name, spy)
    return seen


def test_every_call_the_backend_makes_is_covered() -> None:
    """The cases below cover every function the simulation answers (and so every call the backend may make)."""
    mod = ncclsim.module()
    simulated = {n for n in dir(mod) if not n.startswith("_") and getattr(getattr(mod, n), "__module__", None) ==
                 ncclsim.__name__}
    assert simulated - {"get_error_string"} == {c[0] for c in CASES}  # error strings: test_error_strings_are_ncclx


@pytest.mark.parametrize(("name", "call", "want", "result", "check"), CASES, ids=[c[0] for c in CASES])
def test_arguments_reach_the_simulation_and_results_come_back(monkeypatch: pytest.MonkeyPatch, name: str,
                                                              call: Callable[[], Any], want: tuple[Any, ...],
                                                              result: Any, check: Callable[[Any], bool]) -> None:
    seen = _spy(monkeypatch, name, lambda: result)
    got = call()
    assert seen == [want]
    assert check(got), got


@pytest.mark.parametrize(("name", "call"), [(c[0], c[1]) for c in CASES], ids=[c[0] for c in CASES])
def test_errors_come_back_as_nccl_raises_them(monkeypatch: pytest.MonkeyPatch, name: str,
                                              call: Callable[[], Any]) -> None:
    """An NCCLError of the simulation is the call's ncclResult_t: nccl4py raises NCCLError with that code; any other
    exception (e.g. the FunctionNotFoundError of a function the simulated version lacks) is raised as it is."""
    for code in (1, 2, 3, 4, 5, 6, 8):
        def fail(code: int = code) -> Any:
            raise real.NCCLError(code)

        _spy(monkeypatch, name, fail)
        with pytest.raises(real.NCCLError) as err:
            call()
        assert err.value.status == code
    other = FunctionNotFoundError(f"function {name} is not found")

    def lost() -> Any:
        raise other

    _spy(monkeypatch, name, lost)
    with pytest.raises(FunctionNotFoundError) as raised:
        call()
    assert raised.value is other


def test_a_config_is_read_as_nccl_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """init.cc parseCommConfig: a magic other than NCCL_API_MAGIC is ncclInvalidArgument before anything else; a
    smaller ``size`` than NCCL's struct means the fields past it are NCCL_CONFIG_INITIALIZER's."""
    seen = _spy(monkeypatch, "comm_split", lambda: real.Comm(0xBEEF_0300))
    bad = _config(**CFG)
    bad.magic = 0x1234
    with pytest.raises(real.NCCLError) as err:
        real.comm_split(real.Comm(H), 2, 9, bad)
    assert err.value.status == 4 and seen == []
    short = _config(**CFG)
    short.size_ = 20  # size, magic, version and blocking
    assert real.comm_split(real.Comm(H), 2, 9, short).handle == 0xBEEF_0300
    undef = ncclsim.UNDEF
    assert seen == [(("Comm", H), 2, 9, ("Config", 0, undef, undef, undef, ""))]


def test_null_out_parameters_are_invalid_arguments() -> None:
    """What nccl4py never passes, called on the stub directly: init.cc's PtrCheck of out-parameters."""
    lib = stublib.load()
    assert lib.ncclGetVersion(None) == 4
    assert lib.ncclCommCount(ctypes.c_void_p(H), None) == 4
    assert lib.ncclCommGetAsyncError(ctypes.c_void_p(H), None) == 4
    assert lib.ncclCommGetUniqueId(ctypes.c_void_p(H), None) == 4
    assert lib.ncclCommGrow(None, 3, None, 2, None, None) == 4  # init.cc: "if (newcomm == NULL)" first


def test_error_strings_are_ncclx() -> None:
    """ncclGetErrorString's texts are NCCL's own (the real library's, compared)."""
    path = stublib.real_libnccl()
    assert path is not None, "no NVIDIA libnccl: install the test-cu13 (or test-cu12) extra"
    nvidia = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    nvidia.ncclGetErrorString.restype = ctypes.c_char_p
    for code in range(-1, 11):
        assert real.get_error_string(code) == nvidia.ncclGetErrorString(code).decode()
    assert str(real.NCCLError(6)) == "RemoteError (6): remote process exited or there was a network error"


@pytest.mark.parametrize("call", [lambda: real.comm_cu_device(real.Comm(H)), lambda: real.get_last_error(real.Comm(H)),
                                  lambda: real.team_world(real.Comm(H)), lambda: real.mem_alloc(64)],
                         ids=["ncclCommCuDevice", "ncclGetLastError", "ncclTeamWorld", "ncclMemAlloc"])
def test_a_function_the_simulation_does_not_model_raises(call: Callable[[], Any]) -> None:
    with pytest.raises(abi.NotSimulated, match="is not simulated"):
        call()


def test_a_nonblocking_child_is_written_into_the_callers_comm() -> None:
    """init.cc ncclCommInitRankFunc: *newcomm is written when the child's job ends; the binding's Comm shows it
    once the parent has left ncclInProgress."""
    nccl, comm = _init_one(0)
    assert _poll(nccl, comm) == ncclsim.SUCCESS
    child = real.comm_split(comm, 0, 0, _config(blocking=0))
    assert child.handle == 0
    assert _poll(nccl, comm) == ncclsim.SUCCESS
    assert child.handle != 0 and real.comm_user_rank(child) == 0
    for c in (child, comm):
        real.comm_abort(c)


# --- CUDA rules ------------------------------------------------------------------------------------------

def _rt() -> Any:
    from nccl_pg.comm.nccl import _lib

    return _lib.cudart()


def test_elapsed_time_needs_timing_events() -> None:
    """Runtime API, cudaEventElapsedTime: an event created with cudaEventDisableTiming is an invalid handle."""
    rt = _rt()
    simnccl.select_device(1)
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, timed = rt.cudaEventCreateWithFlags(rt.cudaEventDefault)
    _, plain = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    for ev in (timed, plain):
        rt.cudaEventRecord(ev, s)
    rt.cudaStreamSynchronize(s)
    assert rt.cudaEventElapsedTime(timed, plain)[0] == rt.cudaError_t.cudaErrorInvalidResourceHandle
    _, timed2 = rt.cudaEventCreateWithFlags(rt.cudaEventDefault)
    rt.cudaEventRecord(timed2, s)
    rt.cudaStreamSynchronize(s)
    err, ms = rt.cudaEventElapsedTime(timed, timed2)
    assert err == rt.cudaError_t.cudaSuccess and ms >= 0


def test_a_side_thread_without_a_device_makes_a_context_on_gpu_0() -> None:
    rt = _rt()
    simnccl.select_device(1)
    _, ev = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    t = threading.Thread(target=lambda: rt.cudaEventQuery(ev))  # never chose a device: its current one is 0
    t.start()
    t.join()
    assert any("context was created on device 0" in v for v in simnccl.violations())
    simnccl.clear()

    def chosen() -> None:
        rt.cudaSetDevice(1)
        rt.cudaEventQuery(ev)

    t = threading.Thread(target=chosen)
    t.start()
    t.join()
    assert simnccl.violations() == []


@pytest.mark.parametrize(("mode", "invalidated"), [(0, True), (1, False), (2, False)])
def test_unsafe_calls_during_a_capture(mode: int, invalidated: bool) -> None:
    """cudaThreadExchangeStreamCaptureMode: a cudaMalloc on another thread invalidates a global capture only
    when that thread is in global mode."""
    rt = _rt()
    simnccl.select_device(1)
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    rt.cudaStreamBeginCapture(s, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)
    seen = []

    def other() -> None:
        rt.cudaSetDevice(1)
        rt.cudaThreadExchangeStreamCaptureMode(mode)
        seen.append(rt.cudaMalloc(16)[0])

    t = threading.Thread(target=other)
    t.start()
    t.join()
    err, _ = rt.cudaStreamEndCapture(s)
    if invalidated:
        assert seen == [rt.cudaError_t.cudaErrorStreamCaptureUnsupported]
        assert err == rt.cudaError_t.cudaErrorStreamCaptureInvalidated
    else:
        assert seen == [rt.cudaError_t.cudaSuccess] and err == rt.cudaError_t.cudaSuccess
    simnccl.clear()


def test_unordered_streams_are_a_race() -> None:
    rt = _rt()
    simnccl.select_device(1)
    _, a = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, b = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, src = rt.cudaMalloc(64)
    _, dst = rt.cudaMalloc(64)
    rt.cudaMemsetAsync(src, 1, 64, a)
    rt.cudaMemcpyAsync(dst, src, 64, rt.cudaMemcpyKind(3), b)  # b reads what a writes, unordered
    assert any(v.startswith("race") for v in simnccl.violations())
    simnccl.clear()
    _, ev = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    rt.cudaMemsetAsync(src, 2, 64, a)
    rt.cudaEventRecord(ev, a)
    rt.cudaStreamWaitEvent(b, ev, 0)
    rt.cudaMemcpyAsync(dst, src, 64, rt.cudaMemcpyKind(3), b)
    rt.cudaStreamSynchronize(b)
    assert simnccl.violations() == []
    assert cudart.view(dst, 64, "check")[0] == 2


# --- NCCL rules, through nccl4py and the stub -----------------------------------------------------------------

def _init_one(blocking: int) -> Any:
    simnccl.select_device(1)
    return real, real.comm_init_rank_config(1, real.get_unique_id(), 0, _config(blocking=blocking))


def _poll(nccl: Any, comm: Any) -> int:
    deadline = time.monotonic() + 10
    while (code := nccl.comm_get_async_error(comm)) == ncclsim.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.001)
    return code


def test_nonblocking_init_and_split_protocol() -> None:
    """init.cc: handle at once, ncclInProgress until ready; a split child is NULL until the parent's job ends,
    and the parent refuses use meanwhile (ncclCommEnsureReady) and is left in error."""
    nccl, comm = _init_one(0)
    assert comm.handle != 0
    assert _poll(nccl, comm) == ncclsim.SUCCESS
    child = nccl.comm_split(comm, 0, 0, _config(blocking=0))
    assert child.handle == 0 and nccl.comm_get_async_error(comm) == ncclsim.IN_PROGRESS
    with pytest.raises(real.NCCLError, match="InvalidArgument"):
        nccl.comm_user_rank(comm)
    assert _poll(nccl, comm) == ncclsim.SUCCESS and child.handle != 0
    assert nccl.comm_user_rank(child) == 0 and nccl.comm_count(child) == 1
    child2 = nccl.comm_split(comm, 0, 0, _config(blocking=0))
    with pytest.raises(real.NCCLError, match="InvalidArgument"):  # an enqueue while in progress ...
        nccl.all_reduce(0, 0, 0, 7, 0, comm, 0)
    assert nccl.comm_get_async_error(comm) == ncclsim.INVALID_ARGUMENT  # ... leaves the parent in error
    for c in (child2, child, comm):
        nccl.comm_abort(c) if c.handle else None
    with pytest.raises(real.NCCLError):
        nccl.comm_get_async_error(comm)  # aborted: freed
    assert any("use after free" in v for v in simnccl.violations())
    simnccl.clear()


def test_nonblocking_collectives_take_a_thread_each_blocking_ones_none() -> None:
    """group.cc ncclGroupEndInternal: a nonblocking group runs on a new thread; a blocking one inline."""
    started = {}
    for blocking in (0, 1):
        nccl, comm = _init_one(blocking)
        assert _poll(nccl, comm) == ncclsim.SUCCESS
        rt = _rt()
        _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
        _, buf = rt.cudaMalloc(16)
        before = simnccl.counters()["threads"]
        for _ in range(5):
            nccl.all_reduce(buf, buf, 4, 7, 0, comm, int(s))
            _poll(nccl, comm)
        started[blocking] = simnccl.counters()["threads"] - before
        rt.cudaStreamSynchronize(s)
        nccl.comm_finalize(comm)
        assert _poll(nccl, comm) == ncclsim.SUCCESS
        nccl.comm_destroy(comm)
    assert started == {0: 5, 1: 0}


def test_groups_do_not_mix_blocking_and_nonblocking() -> None:
    nccl, a = _init_one(0)
    _, b = _init_one(1)
    assert _poll(nccl, a) == ncclsim.SUCCESS
    rt = _rt()
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, buf = rt.cudaMalloc(16)
    nccl.group_start()
    nccl.all_reduce(buf, buf, 4, 7, 0, a, int(s))
    with pytest.raises(real.NCCLError, match="InvalidArgument"):
        nccl.all_reduce(buf, buf, 4, 7, 0, b, int(s))
    with pytest.raises(real.NCCLError):
        nccl.group_end()
    for c in (a, b):
        nccl.comm_abort(c)


def test_premul_sum_ops() -> None:
    """enqueue.cc: host-immediate scalars are read at creation; builtins and unknown ops cannot be destroyed."""
    nccl, comm = _init_one(1)
    scalar = np.array([0.5], np.float32)
    op = nccl.red_op_create_pre_mul_sum(scalar.ctypes.data, 7, 1, comm)
    scalar[0] = 4.0  # too late: already read
    assert op >= ncclsim.NUM_OPS
    rt = _rt()
    _, s = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    _, buf = rt.cudaMalloc(16)
    host = np.full(4, 3.0, np.float32)
    rt.cudaMemcpyAsync(buf, host.ctypes.data, 16, rt.cudaMemcpyKind(1), s)
    nccl.all_reduce(buf, buf, 4, 7, op, comm, int(s))
    rt.cudaMemcpyAsync(host.ctypes.data, buf, 16, rt.cudaMemcpyKind(2), s)
    assert host.tolist() == [1.5] * 4
    nccl.red_op_destroy(op, comm)
    for bad in (0, op):
        with pytest.raises(real.NCCLError, match="InvalidArgument"):
            nccl.red_op_destroy(bad, comm)
    nccl.comm_destroy(comm)
