"""Dumps and ``nccl-pg trace`` against a hostile local user (issue 14 items
2 and 19): a file planted in a dump folder runs no code, files of other
users and links are refused, the dump pipe is opened only if it is a FIFO
of this user's, dumps default to a private directory, and a writer killed
mid-dump leaves no temporary file behind. Real files, real processes."""

from __future__ import annotations

import os
import pickle
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from nccl_pg.cli import main as cli
from nccl_pg.diagnostics import dump, trace

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="giving a file to another user needs root")
OTHER_UID = 54321


def _torch_dump(rank: int) -> dict[str, Any]:
    """A small dump in PyTorch's layout (one completed all_reduce)."""
    entry = {"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1,
             "p2p_seq_id": 0, "op_id": 1, "profiling_name": "nccl:all_reduce", "time_created_ns": 1,
             "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
             "state": "completed", "retired": True, "is_p2p": False}
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "pg_status": {}, "entries": [entry], "rank": rank}


class _Planted:
    """Unpickling this calls exec(): what a hostile user would plant."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def _report(directory: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    import json

    capsys.readouterr()
    code = cli.main(["trace", str(directory), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_planted_pickle_runs_no_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pickle that would call exec() when loaded is reported as not a readable dump; the other dumps are
    analyzed; nothing ran."""
    marker = tmp_path / "marker"
    d = tmp_path / "dumps"
    d.mkdir()
    (d / "trace_0").write_bytes(pickle.dumps({"entries": [], "x": _Planted(str(marker))}))
    (d / "trace_1").write_bytes(pickle.dumps(_torch_dump(1)))
    code, report = _report(d, capsys)
    assert not marker.exists(), "unpickling the planted file ran its code"
    bad = [p for p in report["problems"] if p["kind"] == "unreadable"]
    assert len(bad) == 1 and bad[0]["path"].endswith("trace_0"), report["problems"]
    assert "not a readable dump" in bad[0]["message"] and "builtins.exec" in bad[0]["message"], bad
    assert report["ranks"] == [1] and code == trace.EXIT_PROBLEMS


def test_links_are_not_followed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A symbolic link among the dumps (to a file another user could swap) is refused, not followed."""
    d = tmp_path / "dumps"
    d.mkdir()
    (tmp_path / "elsewhere").write_bytes(pickle.dumps(_torch_dump(0)))
    (d / "trace_0").symlink_to(tmp_path / "elsewhere")
    (d / "trace_1").write_bytes(pickle.dumps(_torch_dump(1)))
    _, report = _report(d, capsys)
    bad = [p for p in report["problems"] if p["kind"] == "unreadable"]
    assert [os.path.basename(p["path"]) for p in bad] == ["trace_0"] and "symbolic link" in bad[0]["message"], bad
    with pytest.raises(dump.NotADump, match="symbolic link"):
        dump.read(str(d / "trace_0"))


@needs_root
def test_files_of_other_users_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dump owned by another user is refused, naming its owner."""
    d = tmp_path / "dumps"
    d.mkdir()
    for r in (0, 1):
        (d / f"trace_{r}").write_bytes(pickle.dumps(_torch_dump(r)))
    os.chown(d / "trace_0", OTHER_UID, OTHER_UID)
    _, report = _report(d, capsys)
    bad = [p for p in report["problems"] if p["kind"] == "unreadable"]
    assert len(bad) == 1 and f"owned by uid {OTHER_UID}, not by this user" in bad[0]["message"], bad
    assert report["ranks"] == [1]


def test_default_dump_directory_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With NCCL_PG_DEBUG_INFO_TEMP_FILE unset, dumps go to <tmp>/nccl_pg-<uid>/, made 0700; a directory of
    that name that is not this user's (made first by someone else, or a link) is refused."""
    for name in ("NCCL_PG_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    private = tmp_path / f"nccl_pg-{os.getuid()}"
    assert dump.path_for(3) == str(private / "nccl_pg_trace_rank_3")
    st = os.lstat(private)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    path = dump.write("test", 3, [])
    assert path == str(private / "nccl_pg_trace_rank_3") and dump.read(path)["reason"] == "test"
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
    for p in private.iterdir():
        p.unlink()
    private.rmdir()
    (tmp_path / "decoy").mkdir()
    private.symlink_to(tmp_path / "decoy")  # planted in the user's place
    with pytest.raises(OSError, match="not a directory of this user's"):
        dump.path_for(0)
    if ROOT:
        private.unlink()
        private.mkdir(mode=0o777)
        os.chown(private, OTHER_UID, OTHER_UID)
        with pytest.raises(OSError, match="not a directory of this user's"):
            dump.path_for(0)


_PIPE_CHILD = textwrap.dedent('''
    import time
    import numpy as np
    import nccl_pg as dist
    dist.init_process_group("host", store=dist.HashStore(), rank=0, world_size=1, timeout=30)
    dist.all_reduce(np.ones(2))
    time.sleep(60)  # the parent kills it once it has seen what it waits for
''')


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["file", "link", *(["others_fifo"] if ROOT else [])])
def test_dump_pipe_must_be_our_fifo(tmp_path: Path, planted: str) -> None:
    """Something planted where rank 0's dump pipe goes (a regular file holding a byte, a link to one, a FIFO
    of another user's) is not read: no dump is written, and the process says why it has no pipe."""
    prefix = tmp_path / "trace_"
    pipe = Path(f"{prefix}0.pipe")
    target = tmp_path / "target"
    target.write_bytes(b"x")
    if planted == "file":
        pipe.write_bytes(b"x")
    elif planted == "link":
        pipe.symlink_to(target)
    else:
        os.mkfifo(pipe, 0o666)
        os.chown(pipe, OTHER_UID, OTHER_UID)
    env = {**os.environ, "NCCL_PG_DEBUG_INFO_TEMP_FILE": str(prefix), "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", _PIPE_CHILD], env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        while not any("no dump pipe" in ln or "wrote a debug dump" in ln for ln in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stderr.readline())
    finally:
        proc.kill()
        proc.wait()
    assert not os.path.exists(f"{prefix}0"), f"a dump was written through the planted {planted}: {lines}"
    assert any("is not a named pipe of this user's" in ln for ln in lines), lines
    assert os.path.lexists(pipe)  # left alone, not unlinked


_KILLED_WRITER = textwrap.dedent('''
    import pickle, sys, time
    from nccl_pg.diagnostics import dump

    def slow(obj, f):  # half a dump, then the writer is killed
        f.write(pickle.dumps(obj)[:100]); f.flush()
        print("writing", flush=True)
        time.sleep(60)

    pickle.dump = slow
    dump.write("killed mid-dump", 0, [])
''')


@pytest.mark.timeout(60)
def test_writer_killed_mid_dump_leaves_no_temporary_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank SIGKILLed while writing its dump leaves a temporary file; the next dump written on this host in
    that folder removes it (its writer is dead), and trace never reads it."""
    prefix = tmp_path / "trace_"
    env = {**os.environ, "NCCL_PG_DEBUG_INFO_TEMP_FILE": str(prefix), "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(leftovers) == 1 and not os.path.exists(f"{prefix}0"), os.listdir(tmp_path)
    (tmp_path / "trace_1").write_bytes(pickle.dumps(_torch_dump(1)))
    _, report = _report(tmp_path, capsys)
    assert report["ranks"] == [1] and not [p for p in report["problems"] if p["kind"] == "unreadable"], report
    os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"] = str(prefix)
    try:
        dump.write("the next dump", 2, [])
    finally:
        del os.environ["NCCL_PG_DEBUG_INFO_TEMP_FILE"]
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == [], os.listdir(tmp_path)
