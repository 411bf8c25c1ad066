"""One timeout type and one normaliser (nccl_pg/timeouts.py): its rules, and
that every public entry point taking a timeout refuses a bad one exactly as
the normaliser does (same exception type, same message), so that no call
site keeps rules of its own."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nccl_pg as dist
from nccl_pg import env
from nccl_pg.cli import main as cli
from nccl_pg.comm.base import CommConfig
from nccl_pg.group.options import Options
from nccl_pg.store import FileStore, HashStore, PrefixStore, TCPStore, TCPStoreServer
from nccl_pg.store.rendezvous import rendezvous
from nccl_pg.timeouts import MAX_SECONDS, parse_seconds, to_seconds

Policy = dict[str, bool]
DEADLINE: Policy = {"zero": False, "forever": False}
POLL_OK: Policy = {"zero": True, "forever": False}
WAIT: Policy = {"zero": True, "forever": True}


def norm(value: Any, name: str = "timeout", policy: Policy = DEADLINE) -> float:
    return to_seconds(value, name, zero=policy["zero"], forever=policy["forever"])

# --- the normaliser's rules --------------------------------------------------------------------

GOOD_EVERYWHERE = [(1, 1.0), (0.25, 0.25), (timedelta(minutes=2), 120.0), (np.float32(1.5), 1.5),
                   (np.int64(3), 3.0), (Fraction(1, 4), 0.25), (MAX_SECONDS, MAX_SECONDS),
                   (timedelta(milliseconds=1), 0.001)]


@pytest.mark.parametrize("policy", [DEADLINE, POLL_OK, WAIT], ids=["deadline", "zero", "wait"])
@pytest.mark.parametrize("value, seconds", GOOD_EVERYWHERE, ids=str)
def test_accepted_by_every_policy(policy: dict[str, bool], value: Any, seconds: float) -> None:
    got = norm(value, policy=policy)
    assert got == seconds and type(got) is float


@pytest.mark.parametrize("value", [0, 0.0, timedelta(0), -0.0])
def test_zero_is_a_poll_for_waits_and_refused_for_deadlines(value: Any) -> None:
    assert to_seconds(value, zero=True) == 0.0
    assert norm(value, policy=WAIT) == 0.0
    with pytest.raises(ValueError, match=r"^timeout must be a finite duration > 0 s"):
        to_seconds(value)


def test_inf_is_no_limit_only_for_waits() -> None:
    assert norm(math.inf, policy=WAIT) == math.inf
    for policy in (DEADLINE, POLL_OK):
        with pytest.raises(ValueError, match="finite duration"):
            norm(math.inf, policy=policy)


@pytest.mark.parametrize("policy", [DEADLINE, POLL_OK, WAIT], ids=["deadline", "zero", "wait"])
@pytest.mark.parametrize("value", [math.nan, -math.inf, -1, -1e-9, timedelta(seconds=-5), MAX_SECONDS * 2, 1e300,
                                   timedelta.max, np.float64("nan")], ids=str)
def test_refused_by_every_policy(policy: dict[str, bool], value: Any) -> None:
    with pytest.raises(ValueError) as info:
        norm(value, "my_arg", policy)
    message = str(info.value)
    assert message.startswith("my_arg must be ") and message.endswith(f", got {value!r}"), message
    assert f"at most {MAX_SECONDS:.0f} s" in message


@pytest.mark.parametrize("value", [True, False, np.bool_(True), "1", b"1", None, 1j, [1], Path("1")], ids=repr)
def test_types_other_than_numbers_and_timedeltas_are_refused(value: Any) -> None:
    """bool is an int but never meant as seconds; strings are not parsed
    here (parse_seconds is for text)."""
    for policy in (DEADLINE, POLL_OK, WAIT):
        with pytest.raises(TypeError) as info:
            norm(value, "my_arg", policy)
        assert str(info.value) == (f"my_arg must be a number of seconds or a timedelta, got "
                                   f"{type(value).__name__}: {value!r}")


def test_messages_state_the_rule_of_their_policy() -> None:
    rules = {}
    for name, policy in (("deadline", DEADLINE), ("zero", POLL_OK), ("wait", WAIT)):
        with pytest.raises(ValueError) as info:
            norm(-1, policy=policy)
        rules[name] = str(info.value)
    assert "finite duration > 0 s" in rules["deadline"] and "inf" not in rules["deadline"]
    assert "finite duration >= 0 s" in rules["zero"] and "inf" not in rules["zero"]
    assert "duration >= 0 s" in rules["wait"] and "or inf for no limit" in rules["wait"]


@pytest.mark.parametrize("raw, seconds", [("1.5", 1.5), ("2", 2.0), (" 3 ", 3.0), ("1e3", 1000.0)])
def test_parse_seconds_reads_text(raw: str, seconds: float) -> None:
    assert parse_seconds(raw) == seconds


@pytest.mark.parametrize("raw, message", [
    ("", "expected a number of seconds, got ''"), ("5s", "expected a number of seconds, got '5s'"),
    ("0", "must be a finite duration > 0 s"), ("-2", "must be a finite duration > 0 s"),
    ("inf", "must be a finite duration > 0 s"), ("nan", "must be a finite duration > 0 s"),
    ("1e300", "must be a finite duration > 0 s"),
])
def test_parse_seconds_refuses_with_the_text(raw: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_seconds(raw)
    assert str(info.value).startswith(message) and str(info.value).endswith(f"got {raw!r}")


def test_parse_seconds_policies() -> None:
    assert parse_seconds("0", zero=True) == 0.0
    assert parse_seconds("inf", zero=True, forever=True) == math.inf
    with pytest.raises(ValueError, match="or inf for no limit"):
        parse_seconds("nan", zero=True, forever=True)


# --- every entry point goes through it ------------------------------------------------------------

# None is not here: where an entry point takes it, it means "the default".
BAD = [math.nan, 0, -1, math.inf, 1e300, timedelta(0), timedelta.max, True, "10"]


def _refusal(call: Callable[[], Any]) -> tuple[type, str] | None:
    try:
        call()
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    return None


def _expected(value: Any, name: str, policy: dict[str, bool]) -> tuple[type, str] | None:
    return _refusal(lambda: norm(value, name, policy))


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("host", store=HashStore(), rank=0, world_size=1, timeout=30)
    try:
        yield dist.distributed._get_default_group()
    finally:
        dist.destroy_process_group()


def _entry_points(tmp_path: Path, pg: Any) -> list[tuple[str, str, dict[str, bool], Callable[[Any], Any]]]:
    """(what, argument name, policy, call with the timeout) for each public
    entry point that takes a timeout."""
    store = HashStore()
    tcp = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30)
    work = dist.all_reduce(np.ones(2), async_op=True)
    assert work is not None
    return [
        ("new_group", "timeout", DEADLINE, lambda t: dist.new_group([0], timeout=t)),
        ("_set_pg_timeout", "timeout", DEADLINE, lambda t: dist.distributed._set_pg_timeout(t)),
        ("Options", "timeout", DEADLINE, lambda t: Options(timeout=t)),
        ("CommConfig", "CommConfig.timeout", DEADLINE, lambda t: CommConfig(timeout=t)),
        ("Work.wait", "wait(timeout)", WAIT, lambda t: work.wait(t)),
        ("monitored_barrier", "monitored_barrier timeout", POLL_OK,
         lambda t: dist.monitored_barrier(timeout=t)),
        ("ProcessGroup.monitored_barrier", "monitored_barrier timeout", POLL_OK,
         lambda t: pg.monitored_barrier(timeout=t)),
        ("ProcessGroup.shutdown", "shutdown timeout", POLL_OK, lambda t: pg.shutdown(t)),
        ("HashStore", "timeout", DEADLINE, lambda t: HashStore(timeout=t)),
        ("FileStore", "timeout", DEADLINE, lambda t: FileStore(str(tmp_path / "fs"), 1, timeout=t)),
        ("TCPStore", "timeout", DEADLINE,
         lambda t: TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=t)),
        ("TCPStore connect_timeout", "connect_timeout", DEADLINE,
         lambda t: TCPStore("127.0.0.1", tcp.port, is_master=False, timeout=5, connect_timeout=t)),
        ("Store.set_timeout", "timeout", DEADLINE, lambda t: store.set_timeout(t)),
        ("Store.wait", "timeout", DEADLINE, lambda t: store.wait(["k"], t)),
        ("TCPStore.wait", "timeout", DEADLINE, lambda t: tcp.wait(["k"], t)),
        ("PrefixStore.wait", "timeout", DEADLINE, lambda t: PrefixStore("p", store).wait(["k"], t)),
        ("Store.barrier", "timeout", DEADLINE, lambda t: store.barrier("b", 1, t)),
        ("rendezvous", "timeout", DEADLINE,
         lambda t: rendezvous(f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1, timeout=t)),
        ("TCPStoreServer idle_timeout", "idle_timeout", POLL_OK,
         lambda t: TCPStoreServer("127.0.0.1", 0, idle_timeout=t)),
        ("TCPStoreServer handshake_timeout", "handshake_timeout", DEADLINE,
         lambda t: TCPStoreServer("127.0.0.1", 0, handshake_timeout=t)),
    ]


def _refuses_as_the_normaliser(what: str, name: str, policy: dict[str, bool], call: Callable[[Any], Any]) -> int:
    checked = 0
    for bad in BAD:
        expected = _expected(bad, name, policy)
        if expected is not None:  # else allowed by this policy (e.g. 0 for a wait)
            assert _refusal(functools.partial(call, bad)) == expected, (what, bad)
            checked += 1
    return checked


def test_init_process_group_refuses_as_the_normaliser() -> None:
    assert _refuses_as_the_normaliser("init_process_group", "timeout", DEADLINE, lambda t: dist.init_process_group(
        "host", store=HashStore(), rank=0, world_size=1, timeout=t)) == len(BAD)
    assert not dist.is_initialized()


def test_every_entry_point_refuses_as_the_normaliser(tmp_path: Path, world: Any) -> None:
    checked = sum(_refuses_as_the_normaliser(*entry) for entry in _entry_points(tmp_path, world))
    assert checked > 150
    assert dist.distributed._get_default_group().timeout == timedelta(seconds=30)  # nothing half-applied


def test_a_store_barrier_with_a_bad_timeout_leaves_no_trace() -> None:
    """Refused before it counts itself in (it used to add to the barrier's
    counter first, so a corrected retry waited for one caller too many)."""
    store = HashStore(timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        store.barrier("b", 1, math.nan)
    assert not store.check(["b"])
    store.barrier("b", 1, 1)  # the retry completes alone


def test_entry_points_accept_seconds_and_timedeltas_alike(tmp_path: Path, world: Any) -> None:
    work = dist.all_reduce(np.ones(2), async_op=True)
    assert work is not None
    assert work.wait(0) and work.wait(math.inf) and work.wait(timedelta(seconds=1)) and work.wait(np.float64(1))
    dist.monitored_barrier(timeout=0)
    dist.distributed._set_pg_timeout(timedelta(seconds=12))
    assert world.timeout == timedelta(seconds=12)
    # Their fields hold seconds; a timedelta given is converted (as the group timeout's).
    assert CommConfig(timeout=timedelta(seconds=3)).timeout == 3.0  # type: ignore[arg-type]
    assert Options(timeout=timedelta(milliseconds=1500)).timeout == 1.5  # type: ignore[arg-type]
    store = HashStore(timeout=timedelta(seconds=7))
    assert store.timeout == 7.0
    assert TCPStoreServer("127.0.0.1", 0, idle_timeout=0).idle_timeout == 0.0


def test_environment_variable_refuses_as_the_normaliser() -> None:
    for raw in ("0", "-3", "inf", "nan", "x"):
        with pytest.raises(ValueError) as info:
            env.STORE_TIMEOUT.get({env.STORE_TIMEOUT.name: raw})
        with pytest.raises(ValueError) as direct:
            parse_seconds(raw)
        assert str(info.value).endswith(f"{env.STORE_TIMEOUT.name}: {direct.value}"), str(info.value)


@pytest.mark.parametrize("argv, option", [
    (["run", "--max-time", "{}", "job.py"], "--max-time"),
    (["run", "--grace-period", "{}", "job.py"], "--grace-period"),
    (["bench", "--backend", "host", "--timeout", "{}"], "--timeout"),
])
def test_command_line_options_refuse_as_the_normaliser(argv: list[str], option: str, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for raw in ("0", "-1", "inf", "nan", "1e300", "soon"):
        with pytest.raises(SystemExit) as exc:
            cli.main([a.format(raw) for a in argv])
        assert exc.value.code == 2
        with pytest.raises(ValueError) as direct:
            parse_seconds(raw)
        err = capsys.readouterr().err
        assert f"argument {option}: {direct.value}" in err, err


def test_torch_work_wait_goes_through_the_normaliser(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the torch backend needs PyTorch")
    from harness.forked import run_world  # noqa: PLC0415

    messages = run_world(_s_torch_wait, 2, tmp_path, timeout=60, env={"NCCL_PG_DUMP_ON_TIMEOUT": "0"})[0]
    refused, expired = messages
    assert refused == _expected(math.nan, "wait(timeout)", WAIT)[1]  # type: ignore[index]
    # A float is seconds, as pybind11 converts it for torch's Work.wait (it was read as milliseconds).
    assert "Timed out waiting 300ms" in expired, expired


def _s_torch_wait(r: Any) -> tuple[str, str] | None:
    import torch  # noqa: PLC0415
    import torch.distributed as tdist  # noqa: PLC0415
    from harness.torch_ranks import init  # noqa: PLC0415

    init(r, timeout=20)
    tdist.barrier()
    result = None
    t = torch.zeros(1)
    if r.rank == 0:
        work: Any = tdist.irecv(t, 1)  # torch's stubs: Work | None, and wait(timedelta) though a float is accepted
        with pytest.raises(ValueError) as refused:
            work.wait(math.nan)
        with pytest.raises(tdist.DistBackendError) as expired:
            work.wait(0.3)
        r.store().set("tw/send", b"")
        assert work.wait(timedelta(0))  # torch's kNoTimeout: no limit of the wait's own
        assert t.item() == 5.0
        result = (str(refused.value), str(expired.value))
    else:
        r.store().wait(["tw/send"])
        tdist.send(torch.full((1,), 5.0), 0)
    tdist.barrier()
    tdist.destroy_process_group()
    return result
