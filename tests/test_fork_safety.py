"""A process forked after init must not touch the parent's groups (issue 14
item 13): its exit may not abort the inherited communicators (whose sockets
it shares with the parent) nor unlink the parent's dump pipe. Real
processes (tests/harness/procs.py), a real fork of a rank."""

from __future__ import annotations

import pytest
from harness import fork_scenarios as S
from harness.procs import World

pytestmark = pytest.mark.usefixtures("no_children_left")  # every test ends with no child process of ours alive


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_forked_child_leaves_the_parents_group_alone(tmp_path, how):
    """Rank 0 of 2 forks a child after init (os.fork + sys.exit(0): atexit handlers and finalizers run in
    the child; or a multiprocessing 'fork' data loader); afterwards both ranks' all_reduce works (on the
    default group and on a group made directly, which the loader's copy of a dataset drops) and rank 0's
    dump pipe is still there."""
    with World(2, S.fork_child, tmp_path, args={"timeout": 20.0, "how": how}) as w:
        res = w.results(timeout=45)
        logs = w.logs()
    assert res[0]["child"] == 0, res
    for r in (0, 1):
        assert res[r]["after"]["ok"] and res[r]["direct"]["ok"], (r, res[r], logs)
        assert res[r]["sums"] == [2.0, 2.0], res[r]
        assert res[r]["pipe"], res[r]
