"""What reading a folder of dumps may cost (issue 25 item 5): a few bytes of
pickle must not make ``nccl-pg trace`` allocate or walk a lot.

The adversarial files are the issue's (one entry shared 600,000 times: 1.1
MiB that cost 770 MiB and 11-15 s; the same at 2 MB) and the other ways a
small pickle or JSON file makes its reader build much more than its size
(found in nccl_pg/diagnostics/untrusted.py's doc): a memo index far ahead
(9 bytes, 1 GiB), empty sets (1 byte each, 216 bytes of memory each), a long
string shared by many entries, a JSON file of a million empty lists. Each
runs in a real ``nccl-pg trace`` process whose peak memory the test reads
(its VmHWM); the good dump beside them is still analyzed.
"""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.trace_dumps import entry, torch_dump, write

from nccl_pg.diagnostics import trace
from nccl_pg.diagnostics.trace import Limits

_PEAK_MIB = 200  # the command's peak RSS over all the files below (an interpreter with numpy: about 40 MiB)


def _adversarial(d: Path) -> dict[str, str]:
    """Write the files into ``d``; {file name: what its refusal must say}."""
    shared = torch_dump([entry(0, 1)], "[0, 1, 2, 3, 4, 5, 6, 7]")
    files = {}
    for rank, copies in ((1, 600_000), (2, 1_100_000)):  # the 1.1 MiB and 2 MB dumps
        files[f"trace_{rank}"] = pickle.dumps({**shared, "entries": shared["entries"] * copies}, protocol=4)
    files["trace_3"] = b"\x80\x04}r" + struct.pack("<I", 1 << 26) + b"."  # memo index 2**26: 1 GiB of memo table
    files["trace_4"] = b"\x80\x04}\x8c\x07entries](" + b"\x8f" * 1_100_000 + b"es."  # 1.1 M empty sets
    long = entry(0, 1, name="nccl:all_reduce " + "x" * 60_000)
    files["trace_5"] = pickle.dumps({**shared, "entries": [long] * 20_000}, protocol=4)
    files["trace_6.json"] = b'{"entries": [' + b"[]," * 1_000_000 + b"[]]}"
    for name, data in files.items():
        (d / name).write_bytes(data)
    return {"trace_1": "shared many times over", "trace_2": "shared many times over",
            "trace_3": "memo index 67108864 at byte 3 skips ahead", "trace_4": "decoding it would take over 256 MiB",
            "trace_5": "shared many times over", "trace_6.json": "over the limit of 100000 a dump"}


# `nccl-pg trace`, then its peak resident memory: VmHWM, the high-water mark of this process image (getrusage's
# ru_maxrss would also count the image of the test process it was forked from, which execve inherits).
_MEASURED = """
import re, sys
from nccl_pg.diagnostics.trace.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as f:
    print("peak_kib", re.search(r"VmHWM:\\s*(\\d+)", f.read()).group(1), file=sys.stderr)
sys.exit(code)
"""


def _run_measured(args: list[str], stderr: Path) -> tuple[int, bytes, int, float]:
    """``nccl-pg trace ARGS`` in a new process: (exit status, stdout, peak RSS in KiB, seconds)."""
    start = time.monotonic()
    with stderr.open("wb") as err:
        done = subprocess.run([sys.executable, "-c", _MEASURED, *args], stdout=subprocess.PIPE, stderr=err,
                              timeout=100)
    peak = int(stderr.read_text().rsplit("peak_kib ", 1)[1].split()[0])
    return done.returncode, done.stdout, peak, time.monotonic() - start


@pytest.mark.timeout(120)
def test_adversarial_dumps_cost_bounded_memory(tmp_path: Path) -> None:
    """Every adversarial file is reported as not a readable dump, saying why, and the good one is analyzed,
    in a process that never holds more than _PEAK_MIB."""
    d = tmp_path / "dumps"
    d.mkdir()
    write(d, {0: torch_dump([entry(0, 1)], "[0, 1, 2, 3, 4, 5, 6, 7]")}, prefix="trace_")
    expected = _adversarial(d)
    code, out, peak_kib, seconds = _run_measured([str(d), "--json"], tmp_path / "stderr")
    assert code == trace.EXIT_PROBLEMS, (tmp_path / "stderr").read_text()
    report = json.loads(out)
    assert report["ranks"] == [0]
    refused = {Path(p["path"]).name: p["message"] for p in report["problems"] if p["kind"] == "unreadable"}
    assert sorted(refused) == sorted(expected), refused
    for name, why in expected.items():
        assert "not a readable dump (" in refused[name] and why in refused[name], refused[name]
    assert peak_kib < _PEAK_MIB * 1024, f"peak {peak_kib >> 10} MiB"
    print(f"{len(expected)} adversarial dumps refused in {seconds:.1f} s, peak {peak_kib >> 10} MiB")


@pytest.mark.timeout(60)
def test_folder_limit_on_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Dumps are read until the folder's limit of entries (or bytes): the rest are reported as not read,
    saying why."""
    per_rank = [entry(i, i + 1) for i in range(300)]
    d = write(tmp_path / "dumps", {r: torch_dump(per_rank, "[0, 1, 2]") for r in range(3)})
    dumps, problems = trace.load(trace.find_dumps(str(d))[0], Limits(max_entries=700))
    assert sorted(dumps) == [0, 1]
    (p,) = problems
    assert p["ranks"] == [2] and "would pass this folder's limit of 700 entries in all" in p["message"], p
    dumps, problems = trace.load(trace.find_dumps(str(d))[0], Limits(max_entries=600))
    assert sorted(dumps) == [0, 1]
    assert "not read: this folder's limit of 600 entries in all was reached" in problems[0]["message"], problems
    dumps, problems = trace.load(trace.find_dumps(str(d))[0], Limits(max_bytes=1))
    assert sorted(dumps) == [0] and [p["ranks"] for p in problems] == [[1], [2]]
    assert "not read: this folder's limit of 1 bytes read in all was reached" in problems[0]["message"]
    from nccl_pg.cli import main as cli

    capsys.readouterr()
    assert cli.main(["trace", str(d), "--json", "--max-entries", "700"]) == trace.EXIT_PROBLEMS
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == [0, 1] and [p["ranks"] for p in report["problems"] if p["kind"] == "unreadable"] == [[2]]


@pytest.mark.timeout(60)
def test_large_honest_dump_is_read(tmp_path: Path) -> None:
    """A dump ten times the default ring (20,000 entries), its frames shared between entries as torch's
    pickler shares them, is read: the bounds refuse amplification, not size."""
    frames = [{"name": f"f{i}", "filename": f"/src/mod{i}.py", "line": i} for i in range(20)]
    entries = [entry(i, i + 1, frames=frames) for i in range(20_000)]
    d = write(tmp_path / "dumps", {0: torch_dump(entries, "[0]")})
    dumps, problems = trace.load(trace.find_dumps(str(d))[0])
    assert problems == [] and len(dumps[0].entries) == 20_000
    assert dumps[0].entries[-1]["frames"][-1].file == "/src/mod0.py"  # innermost last, as kept
