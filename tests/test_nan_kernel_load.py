"""The NaN check's kernels load on the driver they run on (issue 23, defect 3).

Code from NVRTC X.y loads only on a driver for CUDA X or newer, PTX only on
one for CUDA X.y or newer (CUDA Compatibility, "Minor Version
Compatibility"). The check compiles with the NVRTC of the CUDA runtime's
major, refuses before loading what the driver cannot run, saying which
NVRTC, which driver and what to install, and ``nccl-pg doctor`` loads the
kernels (cuModuleLoadData) or says why not.

The driver is the simulated one (tests/simnccl/module_load.py: the pairing
rule, from NVIDIA's documentation, applied to the image it is given); NVRTC
is the real one, compiling on the CPU. This proves our logic, not GPU
behaviour: the `doctor` stage of tools/gpu_check.sh loads on a real driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import simnccl
from harness.sim_threads import DEVICE
from simnccl import cudart, module_load, xp

import nccl_pg as dist
from nccl_pg import kernels
from nccl_pg.comm.nccl import nan

pytestmark = pytest.mark.timeout(120)


def simulated(test: Callable[..., None]) -> Callable[..., None]:
    """A test on the simulated driver (and fails on any violation the simulation records)."""
    return pytest.mark.simnccl(pytest.mark.usefixtures("simnccl_installed", "no_simnccl_violations")(test))


ROOT = Path(__file__).resolve().parent.parent
SetVersions = Callable[..., module_load.Versions]


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(autouse=True)
def fresh_loads(kernel_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test loads afresh (the check keeps one load per device for the process), with images cached here."""
    monkeypatch.setenv("NCCL_PG_KERNEL_CACHE", str(kernel_cache))
    saved = dict(nan._devices)
    nan._devices.clear()
    yield
    nan._devices.clear()
    nan._devices.update(saved)


@pytest.fixture
def versions() -> Iterator[SetVersions]:
    """Set what the simulated driver and runtime report; restored afterwards."""
    before = module_load.set_versions()
    yield module_load.set_versions
    module_load.set_versions(before.driver, before.runtime)


def nvrtc_major() -> int:
    """The NVRTC this process compiles with (the test install's: CUDA 13 unless CUDA_MAJOR=12)."""
    return kernels.nvrtc_version()[0]


def older_driver(major: int) -> int:
    """A driver one CUDA major older than ``major``'s code needs (for CUDA 13 code: R570, CUDA 12.8)."""
    return (major - 1) * 1000 + 80


# --- the NaN check -----------------------------------------------------------------------------------------

@simulated
def test_an_older_driver_is_refused_before_loading_naming_nvrtc_driver_and_fix(versions: SetVersions) -> None:
    """Issue 23's case (with the CUDA 13 test install): a CUDA 12 runtime, NVRTC 13 the only one found, an
    R570 driver. Before the fix the cubin went to cuModuleLoadData, which the driver refuses, and the first
    NaN check failed with a bare "CUDA error in cuModuleLoadData"."""
    major = nvrtc_major()
    versions(driver=older_driver(major), runtime=(major - 1) * 1000 + 90)
    before = len(module_load.loads().log)
    pg = simnccl.start_world1(device=DEVICE)
    try:
        pg.set_nan_check("raise")
        with pytest.raises(RuntimeError) as err:
            dist.all_reduce(xp.full(8, 1.0, np.float32))
    finally:
        dist.destroy_process_group()
    msg = str(err.value)
    assert isinstance(err.value, kernels.KernelLoadError), msg
    assert f"NVRTC {major}." in msg and kernels.nvrtc().path in msg  # which NVRTC
    assert f"CUDA {major - 1}.8 (cudaDriverGetVersion() = {older_driver(major)})" in msg  # which driver
    assert f"R{kernels.MIN_DRIVER[major]} or newer" in msg  # what it needs
    assert f"pip install {kernels.PACKAGES[major - 1]}" in msg  # what to install
    assert module_load.loads().log[before:] == []  # refused before anything reached the driver


@simulated
def test_a_driver_of_nvrtcs_major_loads_every_kernel(versions: SetVersions) -> None:
    major, minor = kernels.nvrtc_version()
    versions(driver=major * 1000, runtime=major * 1000)  # x.0: older than NVRTC's minor, same major
    report = nan.load_kernels(DEVICE)
    assert (report.device, report.arch, report.functions) == (DEVICE, "sm_90", len(nan.RULES))
    assert report.nvrtc.version == (major, minor) and report.driver_version == major * 1000
    assert module_load.loads().log[-1] == f"loaded cubin of CUDA {major * 1000 + minor * 10} on driver " \
                                          f"{major * 1000}, device {DEVICE}"
    assert nan.load_kernels(DEVICE) is report  # once per device


# --- the simulated driver's rule (its sources: tests/simnccl/module_load.py) ---------------------------------

def _sim_load(image: bytes) -> int:
    from nccl_pg.comm.nccl import _lib

    simnccl.select_device(DEVICE)
    cudart.cudaFree(0)  # a current context
    err, module = _lib.driver().cuModuleLoadData(image)
    if int(err) == 0:
        _lib.driver().cuModuleUnload(module)
    return int(err)


@simulated
def test_simulated_driver_pairs_images_with_their_compiler(versions: SetVersions) -> None:
    major, minor = kernels.nvrtc_version()
    R = module_load.R
    cubin = kernels.compile_source(kernels.NAN_CHECK, "sm_90")
    ptx = kernels.compile_source(kernels.NAN_CHECK, "compute_90")
    built = major * 1000 + minor * 10
    versions(driver=older_driver(major))
    assert _sim_load(cubin) == R.CUDA_ERROR_INVALID_IMAGE
    versions(driver=major * 1000)
    assert _sim_load(cubin) == R.CUDA_SUCCESS  # minor version compatibility
    versions(driver=built - 10)
    assert _sim_load(ptx) == R.CUDA_ERROR_UNSUPPORTED_PTX_VERSION  # the driver's JIT does not know the ISA
    versions(driver=built)
    assert _sim_load(ptx) == R.CUDA_SUCCESS


# --- check_loadable, the rule nccl_pg applies before loading --------------------------------------------

NV13 = kernels.Nvrtc((13, 5), "/x/libnvrtc.so.13", 12, "chosen by cuda-pathfinder")


@pytest.mark.parametrize("driver,arch,refused", [
    (13000, "sm_90", None),  # a newer minor's cubin loads (minor version compatibility)
    (13050, "compute_90", None),
    (12090, "sm_90", "code from NVRTC 13.x needs a driver for CUDA 13 (R580 or newer"),
    (13040, "compute_90", "PTX (compute_90) from NVRTC 13.5 needs a driver for CUDA 13.5 or newer"),
    (0, "sm_90", "no CUDA driver is installed (cudaDriverGetVersion() = 0)"),
])
def test_check_loadable(driver: int, arch: str, refused: str | None) -> None:
    if refused is None:
        kernels.check_loadable(NV13, driver, arch, 12090)
        return
    with pytest.raises(kernels.KernelLoadError) as err:
        kernels.check_loadable(NV13, driver, arch, 12090)
    assert refused in str(err.value) and "NVRTC 13.5 (/x/libnvrtc.so.13)" in str(err.value)


def test_check_loadable_tells_a_runtime_too_new_for_the_driver() -> None:
    """A CUDA 13 runtime on a CUDA 12 driver: another NVRTC is not enough, the install must be CUDA 12's."""
    with pytest.raises(kernels.KernelLoadError) as err:
        kernels.check_loadable(NV13, 12080, "sm_90", 13000)
    assert "use an install of CUDA 12" in str(err.value) and "nccl_pg[cu12]" in str(err.value)


# --- nccl-pg doctor --------------------------------------------------------------------------------------------

DOCTOR = textwrap.dedent("""
    import json, sys
    import simnccl
    from simnccl import module_load
    from nccl_pg.cli import doctor
    simnccl.install()
    module_load.set_versions(driver=int(sys.argv[1]), runtime=int(sys.argv[2]))
    rc = doctor.main(["--no-sanity", "--json", sys.argv[3]])
    print("VIOLATIONS " + json.dumps(simnccl.violations()))
    sys.exit(rc)
""")


def _doctor(tmp_path: Path, kernel_cache: Path, driver: int, runtime: int) -> tuple[int, dict, str]:
    """`nccl-pg doctor` on the simulated driver, in a process of its own: it loads on every simulated GPU, and
    the contexts it makes there must not change what later tests in this process see."""
    out = tmp_path / "doctor.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
           "NCCL_PG_KERNEL_CACHE": str(kernel_cache)}
    proc = subprocess.run([sys.executable, "-c", DOCTOR, str(driver), str(runtime), str(out)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    assert "VIOLATIONS []" in proc.stdout, proc.stdout + proc.stderr
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    return proc.returncode, results["kernels"], proc.stdout


@pytest.mark.simnccl
def test_doctor_loads_the_kernels_on_every_gpu(tmp_path: Path, kernel_cache: Path) -> None:
    """Before the fix doctor only compiled (its "kernels compile" said nothing of the driver)."""
    major = nvrtc_major()
    _, probe, text = _doctor(tmp_path, kernel_cache, major * 1000, major * 1000)
    assert probe["status"] == "ok", probe
    loaded = probe["data"]["loaded"]
    assert [x["device"] for x in loaded] == [0, 1]  # the simulation's two GPUs
    assert all(x["driver"] == major * 1000 and x["functions"] == len(nan.RULES) for x in loaded)
    assert "and loaded (cuModuleLoadData) by a driver for CUDA" in text


@pytest.mark.simnccl
def test_doctor_says_why_the_kernels_cannot_load(tmp_path: Path, kernel_cache: Path) -> None:
    major = nvrtc_major()
    rc, probe, _ = _doctor(tmp_path, kernel_cache, older_driver(major), (major - 1) * 1000 + 90)
    assert rc == 1 and probe["status"] == "FAIL", probe
    assert f"NVRTC {major}." in probe["detail"] and f"cudaDriverGetVersion() = {older_driver(major)}" in probe["detail"]
    assert f"pip install {kernels.PACKAGES[major - 1]}" in probe["detail"]


@pytest.mark.simnccl
def test_doctor_without_a_driver_compiles_and_says_nothing_loads(tmp_path: Path, kernel_cache: Path) -> None:
    major = nvrtc_major()
    _, probe, _ = _doctor(tmp_path, kernel_cache, 0, major * 1000)
    assert probe["status"] == "skip", probe
    assert f"compiles with NVRTC {major}." in probe["detail"]
    assert probe["detail"].endswith("not loaded: no CUDA driver (cudaDriverGetVersion() = 0)")


# --- which libnvrtc: the runtime's major first ----------------------------------------------------------

STUB = "int nvrtcVersion(int *major, int *minor) {{ *major = {major}; *minor = 8; return 0; }}\n"


def _stub_wheel(root: Path, major: int) -> Path:
    """A folder laid out like NVIDIA's wheel of CUDA ``major``'s NVRTC, holding a stand-in libnvrtc that only
    answers nvrtcVersion (major.8): a second real NVRTC cannot be installed beside the test install's."""
    lib = root / "nvidia" / "cuda_nvrtc" / "lib" / f"libnvrtc.so.{major}"
    lib.parent.mkdir(parents=True)
    src = root / "stub.c"
    src.write_text(STUB.format(major=major))
    subprocess.run(["cc", "-shared", "-fPIC", f"-Wl,-soname,libnvrtc.so.{major}", "-o", str(lib), str(src)],
                   check=True, capture_output=True, timeout=60)
    return lib


PROBE = textwrap.dedent("""
    import json, sys
    from nccl_pg import kernels
    nv = kernels.select_nvrtc(int(sys.argv[1]))
    from cuda.bindings import nvrtc
    from cuda.pathfinder import load_nvidia_dynamic_lib
    err, major, minor = nvrtc.nvrtcVersion()
    print(json.dumps({"chosen": [list(nv.version), nv.path, nv.how], "bindings": [major, minor],
                      "pathfinder": load_nvidia_dynamic_lib("nvrtc").abs_path}))
""")


def _probe(major: int, pythonpath: list[Path]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*pythonpath, ROOT]))}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(major)], capture_output=True, text=True, timeout=60,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_runtimes_nvrtc_is_loaded_before_cuda_bindings_picks_one(tmp_path: Path) -> None:
    """With the test install's NVRTC found first by cuda-pathfinder, a CUDA 12 runtime's choice is still
    libnvrtc.so.12, and cuda.bindings.nvrtc calls it (cuda-pathfinder returns the library already loaded)."""
    other = 12 if nvrtc_major() != 12 else 11
    stub = _stub_wheel(tmp_path, other)
    out = _probe(other, [tmp_path])
    assert out["chosen"] == [[other, 8], str(stub), f"chosen for the CUDA {other} runtime in use"]
    assert out["bindings"] == [other, 8] and out["pathfinder"] == str(stub)


def test_without_the_runtimes_nvrtc_the_one_found_is_used_and_said() -> None:
    out = _probe(11, [])
    assert out["chosen"][0] == list(kernels.nvrtc_version()) == out["bindings"]
    assert out["chosen"][2].startswith("chosen by cuda-pathfinder, as no libnvrtc.so.")
