"""The NaN-check primitives (NCCL_PG_NAN_CHECK): the CUDA kernels compile with
NVRTC on any machine, their source emulated on the CPU, and the numpy scan's
indices for every dtype. The modes on the backends are in test_nan_check.py."""

from __future__ import annotations

import os
import random
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_nan_check import DTYPES, dtype, nan_of

from nccl_pg import kernels
from nccl_pg.comm import nan_scan
from nccl_pg.comm.nan_scan import RULES, first_nan, first_nan_of, lane_dtype

ENTRY_POINTS = sorted(rule.kernel for rule in RULES.values())


def nvrtc_or_skip() -> None:
    """CI (CI=true) installs NVRTC with the test extra: there a missing NVRTC fails."""
    try:
        kernels.nvrtc_version()
    except RuntimeError as exc:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(str(exc))


# ================================ kernels and NVRTC ============================================

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_for_arch(arch: str) -> None:
    nvrtc_or_skip()
    cubin = kernels.compile_source(kernels.NAN_CHECK, arch)
    assert cubin[:4] == b"\x7fELF"
    symbols = set(re.findall(rb"nan_check_\w+", cubin))
    assert symbols >= {name.encode() for name in ENTRY_POINTS}


def test_ptx_exposes_every_entry_point() -> None:
    nvrtc_or_skip()
    ptx = kernels.compile_source(kernels.NAN_CHECK, "compute_80").decode().rstrip("\0")
    entries = sorted(re.findall(r"\.visible \.entry (\w+)\(", ptx))
    assert entries == ENTRY_POINTS
    assert "ld.global.nc.v2.u64" in ptx  # 16-byte read-only loads
    assert "atom.global.min.u64" in ptx


def test_kernel_constants_match_the_python_rules() -> None:
    """The .cu's per-dtype constants are those numpy checks with (tested exhaustively below)."""
    source = kernels.source_path(kernels.NAN_CHECK).read_text()
    found = {name: (int(m, 16), int(t, 16)) for name, m, t in
             re.findall(r"NAN_CHECK\((\w+), \w+, (0x[0-9a-f]+)ull, (0x[0-9a-f]+)ull\)", source)}
    assert found == {r.kernel: (r.mask, r.largest) for r in RULES.values()}


def test_disk_cache_keyed_by_source_arch_and_nvrtc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvrtc_or_skip()
    monkeypatch.setenv("NCCL_PG_KERNEL_CACHE", str(tmp_path))
    path = kernels.cache_path(kernels.NAN_CHECK, "sm_80")
    major, minor = kernels.nvrtc_version()
    assert path.parent == tmp_path and path.name.endswith(f"-sm_80-nvrtc{major}.{minor}.cubin")
    image = kernels.image(kernels.NAN_CHECK, "sm_80")
    assert path.read_bytes() == image  # compiled, then cached
    path.write_bytes(b"from the cache")
    assert kernels.image(kernels.NAN_CHECK, "sm_80") == b"from the cache"  # second use: a hit
    other = kernels.cache_path(kernels.NAN_CHECK, "sm_90")
    assert other != path and not other.exists()
    assert kernels.image(kernels.NAN_CHECK, "sm_90")[:4] == b"\x7fELF"  # another arch: a miss, compiled
    assert other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, other.name])  # no temporaries left


def test_cache_key_follows_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvrtc_or_skip()
    monkeypatch.setenv("NCCL_PG_KERNEL_CACHE", str(tmp_path))
    digest = re.search(r"-([0-9a-f]{16})-", kernels.cache_path(kernels.NAN_CHECK, "sm_80").name)
    import hashlib

    source = kernels.source_path(kernels.NAN_CHECK).read_bytes()
    assert digest and hashlib.sha256(source + b" ".join(o.encode() for o in kernels._OPTIONS)).hexdigest()[:16] \
        == digest.group(1)


def test_arch_for_newer_gpu_falls_back_to_ptx() -> None:
    nvrtc_or_skip()
    known = kernels.supported_archs()
    assert kernels.arch_for(80) == "sm_80"
    assert kernels.arch_for(max(known) + 1) == f"compute_{max(known)}"


def test_compile_error_shows_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvrtc_or_skip()
    with pytest.raises(RuntimeError, match="sm_1"):
        kernels.compile_source(kernels.NAN_CHECK, "sm_1")


# ================================ the kernels' source, emulated on the CPU =====================

EMULATED = ["nan_check_f16", "nan_check_bf16", "nan_check_f32", "nan_check_f64", "nan_check_e4m3", "nan_check_e5m2"]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory):
    """kernels/nan_check.cu compiled for the CPU by g++ (tests/nan_kernel_emulation.cpp)."""
    import ctypes
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("needs g++ to emulate the kernels on the CPU")
    lib = tmp_path_factory.mktemp("emu") / "nan_emu.so"
    source = kernels.source_path(kernels.NAN_CHECK)
    subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror", "-Wno-unknown-pragmas",
                    f'-DKERNEL_SOURCE="{source}"', str(Path(__file__).with_name("nan_kernel_emulation.cpp")),
                    "-o", str(lib)], check=True, capture_output=True, timeout=120)
    dll = ctypes.CDLL(str(lib))
    dll.run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64),
                        ctypes.c_uint64, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
    return dll


def _emulate(dll, name: str, raw: np.ndarray, offset: int, n: int, grid: int, block: int, base: int = 0) -> int | None:
    import ctypes

    first = ctypes.c_uint64(2**64 - 1)
    flags = dll.run(EMULATED.index(RULES[name].kernel), raw.ctypes.data + offset, n, ctypes.byref(first), base,
                    0, grid, block)
    assert flags == 0, "misaligned 16-byte load" if flags & 2 else "trapped without trap mode"
    return None if first.value == 2**64 - 1 else first.value


@pytest.mark.parametrize("name", list(RULES))
def test_kernel_source_head_body_tail_and_indices(emulated, name: str) -> None:
    """Every start alignment (element-misaligned too), sizes around the 16-byte vectors, grids of one
    and of several blocks; NaNs planted just outside the range must not be seen."""
    size_of = dtype(name).itemsize
    nan = np.frombuffer(np.array(RULES[name].mask, RULES[name].bits).tobytes(), np.uint8)  # all payload bits set
    rng = random.Random(7)
    for n in (1, 2, 3, 7, 15, 16, 17, 33, 64, 255, 1000, 4099):
        for offset in sorted({0, size_of, 3 * size_of, 8, 13 * size_of, 1}):
            raw = np.zeros(48 + offset + (n + 1) * size_of, np.uint8)
            start = 16 + (-raw.ctypes.data) % 16 + offset  # ``offset`` bytes past a 16-byte boundary
            for at in (None, 0, n - 1, rng.randrange(n)):
                raw[:] = 0
                for byte in (start - size_of, start + n * size_of):  # NaNs just outside: must not be read
                    raw[byte:byte + size_of] = nan
                if at is not None:
                    raw[start + at * size_of:start + (at + 1) * size_of] = nan
                for grid, block in ((1, 32), (3, 32), (2, 256)):
                    got = _emulate(emulated, name, raw, start, n, grid, block, base=1000)
                    want = None if at is None else 1000 + at
                    assert got == want, (name, n, offset, at, grid, block, got)


def test_kernel_source_first_of_several_and_trap(emulated) -> None:
    import ctypes

    a = np.zeros(4096, np.float32)
    a[[3000, 1234, 4000]] = np.nan
    assert _emulate(emulated, "float32", a.view(np.uint8), 0, a.size, 4, 64) == 1234
    first = ctypes.c_uint64(2**64 - 1)
    assert emulated.run(EMULATED.index("nan_check_f32"), a.ctypes.data, a.size, ctypes.byref(first), 0, 1, 4, 64) == 1


# ================================ numpy scan ===================================================

def test_rules_exhaustive_for_8_and_16_bit_dtypes() -> None:
    for name in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
        rule = RULES[name]
        bits = np.arange(2 ** (8 * np.dtype(rule.bits).itemsize), dtype=rule.bits)
        truth = np.isnan(bits.view(dtype(name)).astype(np.float32))
        assert ((bits & rule.mask) > rule.largest).tolist() == truth.tolist(), name


def test_swar_word_test_matches_lanes() -> None:
    """The kernels' test of every lane of a 64-bit word at once, on random words with planted NaNs."""
    rng = np.random.default_rng(1)
    for name, rule in RULES.items():
        width = 8 * np.dtype(rule.bits).itemsize
        ones = 1 if width == 64 else (2**64 - 1) // (2**width - 1)
        mask, add, top = rule.mask * ones, (rule.mask - rule.largest) * ones, (rule.mask + 1) * ones
        words = rng.integers(0, 2**64, 4000, dtype=np.uint64)
        lanes = words.view(rule.bits).copy()
        lanes[rng.random(lanes.size) < 0.05] = np.array(rule.mask, rule.bits)  # NaN with every payload bit set
        words = lanes.view(np.uint64)
        hits = ((words & np.uint64(mask)) + np.uint64(add)) & np.uint64(top)
        per_lane = ((lanes & rule.bits(rule.mask)) > rule.bits(rule.largest)).reshape(len(words), -1)
        assert ((hits != 0) == per_lane.any(axis=1)).all(), name
        # as the kernel: (__ffsll(h) - 1) / BITS, __ffsll(h) being the 1-based position of the lowest set bit
        first_lane = [((int(h) & -int(h)).bit_length() - 1) // width for h in hits]
        for w in np.flatnonzero(hits):
            assert first_lane[w] == int(np.argmax(per_lane[w])), name


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("size", [1, 7, nan_scan._CHUNK // 2 + 3, nan_scan._CHUNK + 5])  # across numpy chunks
def test_first_nan_index(name: str, size: int) -> None:
    dt = dtype(name)
    a = np.ones(size, dt)
    assert first_nan_of([a]) is None
    per = lane_dtype(dt)[1]  # type: ignore[index]
    for at in sorted({0, size - 1, random.randrange(size)}):
        b = a.copy()
        b[at] = nan_of(name)
        if at + 1 < size:
            b[-1] = nan_of(name)  # a later NaN does not win
        lane = first_nan_of([b])
        assert lane is not None and lane // per == at, (name, size, at)


def test_specials_that_are_not_nan() -> None:
    for name in ("float16", "bfloat16", "float32", "float64", "float8_e5m2"):
        a = np.array([np.inf, -np.inf, -0.0, 0.0, 1.0], dtype(name))
        assert first_nan(a) is None, name
    e4m3 = np.array([0x7E, 0xFE, 0x00, 0x80], np.uint8).view(dtype("float8_e4m3fn"))  # +-448, +-0
    assert first_nan(e4m3) is None
    assert first_nan(np.array([0x7E, 0xFF], np.uint8).view(dtype("float8_e4m3fn"))) == 1  # negative NaN
    assert first_nan(np.array([1.0, -np.nan], np.float32)) == 1


def test_several_arrays_and_complex_parts() -> None:
    a, b = np.ones(5, np.complex64), np.ones(3, np.complex64)
    b[2] = complex(1, np.nan)
    assert first_nan_of([a, b]) == 2 * 5 + 2 * 2 + 1  # lanes: 10 in a, then b[2]'s imaginary part
    assert lane_dtype(np.dtype(np.int32)) is None and lane_dtype(np.dtype(bool)) is None
