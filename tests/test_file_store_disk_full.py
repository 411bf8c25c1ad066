"""FileStore on a full disk (issue 25 item 3): a write that fails, or writes
less than its record, raises DistStoreError and leaves the store as it was:
no partial record in the file, nothing applied in memory, no blame on
"another program" afterwards, and every other user sees the store whole.

The full disk is played by RLIMIT_FSIZE in a child process, with SIGXFSZ
ignored: a write that would cross the limit writes up to it and returns the
short count, the next one fails with EFBIG, as a write to a full disk
returns short and then fails with ENOSPC."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nccl_pg.store import FileStore

pytestmark = pytest.mark.timeout(60)

CHILD = r"""
import os, resource, signal, sys
from nccl_pg.errors import DistStoreError
from nccl_pg.store import FileStore

path, room = sys.argv[1], int(sys.argv[2])
store = FileStore(path, timeout=5)
size = os.path.getsize(path)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + room, hard))

def fails(what, call):
    try:
        call()
    except DistStoreError as exc:
        message = str(exc)
        assert "another program" not in message, message
        print(what, "refused:", message, flush=True)
    else:
        raise AssertionError(f"{what} did not fail on a full disk")
    assert os.path.getsize(path) == size, f"{what} left {os.path.getsize(path) - size} bytes behind"

# Records larger than the room left (a short write first, where there is room for part of them).
fails("set", lambda: store.set("big", b"x" * 1000))
fails("compare_set", lambda: store.compare_set("a", b"1", b"changed" * 50))
fails("append", lambda: store.append("a", b"more" * 100))
fails("multi_set", lambda: store.multi_set(["c", "d"], [b"3" * 500, b"4"]))
fails("queue_push", lambda: store.queue_push("q", b"item" * 100))
if room == 0:  # records of a few bytes fail only on a disk with no room at all
    fails("add", lambda: store.add("n", 5))
    fails("delete_key", lambda: store.delete_key("a"))
    fails("queue_pop", lambda: store.queue_pop("p"))
# Nothing of it was applied in memory either: this process still reads the store as it was.
assert not store.check(["big"]) and not store.check(["c"]) and not store.check(["q"])
assert store.get("n") == b"3" and store.get("a") == b"1"
assert store.queue_len("p") == 1
assert sorted(store.list_keys()) == ["a", "n"]

resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space again: the same store object works on
store.set("big", b"x" * 1000)
assert store.add("n", 5) == 8
assert store.queue_pop("p") == b"first"
store.close()
print("ok", flush=True)
"""


def run_child(path: Path, room: int) -> str:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(room)], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("room", [0, 100], ids=["no-room", "short-write"])
def test_failed_write_raises_and_leaves_the_store_as_it_was(tmp_path: Path, room: int) -> None:
    """``room``: bytes the disk has left (0: every write fails at once; 100:
    the first write of a record returns short, the next fails). Before, set()
    returned after writing 100 of 1,020 bytes, the next writer truncated the
    record, and the writer's next call blamed another program."""
    path = tmp_path / "store"
    store = FileStore(path, timeout=5)
    store.set("a", b"1")
    store.add("n", 3)
    store.queue_push("p", b"first")
    size = os.path.getsize(path)
    out = run_child(path, room)
    lines = out.splitlines()
    assert lines[-1] == "ok", out
    refused = [line for line in lines if "refused:" in line]
    assert len(refused) == (8 if room == 0 else 5), out
    for line in refused:
        assert "could not write" in line and "as it was" in line, line
    # Another user (this process) sees every change the child made once it had room, and none of the
    # failed ones: the file holds whole records only.
    assert store.get("big") == b"x" * 1000
    assert store.add("n", 0) == 8
    assert store.get("a") == b"1" and not store.check(["c", "d"]) and store.queue_len("q") == 0
    assert store.queue_len("p") == 0
    assert os.path.getsize(path) > size
    store.close()


def test_a_reader_never_sees_a_half_record(tmp_path: Path) -> None:
    """A fresh user replays the file after the failed writes: it parses
    whole, with the same keys as before (a cut record would raise "is
    corrupted" or be dropped with everything after it)."""
    path = tmp_path / "store"
    keeper = FileStore(path, timeout=5)
    keeper.set("a", b"1")
    keeper.add("n", 3)
    keeper.queue_push("p", b"first")
    run_child(path, 100)
    fresh = FileStore(path, timeout=5)
    assert sorted(fresh.list_keys()) == ["a", "big", "n"]
    assert fresh.get("n") == b"8"
    fresh.close()
    keeper.close()
