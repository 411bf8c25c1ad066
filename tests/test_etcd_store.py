"""EtcdStore on a real etcd cluster (tests/harness/etcd_cluster.py): what the
store suite (test_store*.py, which runs on it too) cannot show: losing a
member in the middle of a job (kill -9), answers lost in flight and sent again
to another member (through a real TCP proxy that drops them), waits that cost
no traffic, jobs sharing a cluster, the etcd:// init method, a process group
on it, forks, and the errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from harness.etcd_cluster import EtcdCluster, fresh_job
from harness.threads import start_thread

from nccl_pg import rendezvous
from nccl_pg.comm.host.bootstrap import host_address
from nccl_pg.errors import DistNetworkError, DistStoreError
from nccl_pg.store import EtcdStore, PrefixStore, etcd_client
from nccl_pg.store.etcd_store import check_job

pytestmark = [pytest.mark.usefixtures("clean_store_env"), pytest.mark.timeout(60)]


def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def on_member(store: EtcdStore, index: int) -> EtcdStore:
    """Make ``store`` talk to member ``index`` first (clients start at a random member)."""
    client = store._client
    with client.lock:
        client.current = index
        idle, client.idle = client.idle, []  # the pool holds connections to the current member only
    for sock, _ in idle:
        sock.close()
    return store


# --- losing a member ------------------------------------------------------------------


def test_every_call_works_after_its_member_is_killed(own_etcd_cluster: EtcdCluster) -> None:
    victim = own_etcd_cluster.leader()  # the leader: the cluster must elect another, too
    store = on_member(EtcdStore(own_etcd_cluster.url, fresh_job(), timeout=20), victim)
    store.set("before", b"1")
    store.queue_push("q", b"item")
    own_etcd_cluster.kill(victim)  # the member this client uses; its pooled connection is now dead
    start = time.monotonic()
    store.set("a", b"A")
    assert store.get("before") == b"1" and store.get("a") == b"A"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("a", b"A", b"B") == b"B"
    store.append("a", b"+")
    store.multi_set(["x", "y"], [b"X", b"Y"])
    assert store.multi_get(["x", "y", "a"]) == [b"X", b"Y", b"B+"]
    store.wait(["x", "q"], timeout=5)
    assert store.check(["x", "q"]) and not store.check(["nothing"])
    assert store.queue_len("q") == 1 and store.queue_pop("q") == b"item"
    assert store.delete_key("x") and not store.check(["x"])
    assert store.num_keys() == 4 and sorted(store.list_keys()) == ["a", "before", "n", "y"]
    store.barrier("alone", 1)
    assert store._client.current != victim
    assert time.monotonic() - start < 20  # all within one call's deadline together, let alone each
    store.close()


def test_blocked_waits_complete_when_their_member_dies(own_etcd_cluster: EtcdCluster) -> None:
    """wait, get and queue_pop parked on a watch at the leader; the leader is
    killed; the keys are then set through another member: every call completes."""
    job, victim = fresh_job(), own_etcd_cluster.leader()
    waiter = on_member(EtcdStore(own_etcd_cluster.url, job, timeout=30), victim)
    writer = on_member(EtcdStore(own_etcd_cluster.url, job, timeout=30), (victim + 1) % 3)
    calls = {"wait": lambda: waiter.clone().wait(["k"]), "get": lambda: waiter.clone().get("g"),
             "queue_pop": lambda: waiter.clone().queue_pop("q")}
    running = {name: start_thread(call) for name, call in calls.items()}
    until(lambda: len(waiter._client.streams) == 4)  # wait watches values and queues; get and pop one each
    own_etcd_cluster.kill(victim)
    # the waits moved to another member: their watches are open there (a stream names its member when
    # opened; its socket may be closed under this check by the wait that is leaving it)
    dead = waiter._client.names[victim]
    until(lambda: len(waiter._client.streams) == 4 and all(s.member != dead for s in list(waiter._client.streams)), 20)
    writer.set("k", b"K")
    writer.set("g", b"G")
    writer.queue_push("q", b"Q")
    for name, (thread, _out) in running.items():
        thread.join(20)
        assert not thread.is_alive(), name
    assert [running[n][1] for n in calls] == [[None], [b"G"], [b"Q"]]


@pytest.mark.timeout(120)
def test_a_job_survives_the_loss_of_a_member(own_etcd_cluster: EtcdCluster, spawn: Callable[..., subprocess.Popen]) -> None:
    """Four processes run rounds of rendezvous (set, add, barrier, multi_get,
    queue push/pop) on etcd; the leader is killed with SIGKILL in the middle.
    Every process finishes every round, and no add was lost or counted twice."""
    job, n, rounds = fresh_job(), 4, 30
    code = (
        "import sys\nfrom nccl_pg.store import EtcdStore\n"
        "url, job, rank, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])\n"
        "s = EtcdStore(url, job, timeout=40)\n"
        "for r in range(rounds):\n"
        "    s.set(f'r{r}/{rank}', str(r * rank))\n"
        "    s.add('total', rank + 1)\n"
        "    s.queue_push(f'q{r}', str(rank))\n"
        "    s.barrier(f'b{r}', n)\n"
        "    assert s.multi_get([f'r{r}/{i}' for i in range(n)]) == [str(r * i).encode() for i in range(n)]\n"
        "    s.queue_pop(f'q{r}')\n"
        "s.barrier('end', n)\n"
        "print('ok', s.get('total').decode(), flush=True)\n"
    )
    procs = [spawn(code, own_etcd_cluster.url, job, rank, n, rounds) for rank in range(n)]
    observer = EtcdStore(own_etcd_cluster.url, job, timeout=60)
    observer.wait([f"r{rounds // 3}/0"])
    assert not observer.check([f"r{rounds - 1}/0"])  # in the middle of the job
    own_etcd_cluster.kill(own_etcd_cluster.leader())
    outputs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * n, outputs
    total = rounds * sum(range(1, n + 1))
    assert outputs == [f"ok {total}\n"] * n
    assert [observer.queue_len(f"q{r}") for r in range(rounds)] == [0] * rounds  # each item popped once
    observer.close()


@pytest.mark.parametrize("timeout", [4.0, 25.0])
def test_a_silent_member_is_left_for_the_next(own_etcd_cluster: EtcdCluster, timeout: float) -> None:
    """A frozen (SIGSTOPped) member is left within the request's deadline,
    whatever the store's timeout (the production constants: before issue 33
    a timeout under 20 s never left it)."""
    follower = next(i for i in range(3) if i != own_etcd_cluster.leader())
    store = on_member(EtcdStore(own_etcd_cluster.url, fresh_job(), timeout=timeout), follower)
    store.set("a", b"1")  # a pooled connection to the follower, which stays open
    own_etcd_cluster.freeze(follower)
    start = time.monotonic()
    store.set("b", b"2")
    assert store.get("a") == b"1" and store.add("n", 1) == 1
    took = time.monotonic() - start
    # left after half the time left, at most SILENT_AFTER; then three calls on a live member
    assert took < min(timeout, etcd_client.SILENT_AFTER + 3) and store._client.current != follower, took


def test_parked_watches_have_tcp_keepalive(etcd_cluster: EtcdCluster) -> None:
    """A vanished machine sends no reset: the kernel's keepalive probes find it (not exercised
    here: that needs a network that drops packets; this checks the sockets are armed)."""
    store = EtcdStore(etcd_cluster.url, fresh_job(), timeout=20)
    t, out = start_thread(lambda: store.wait(["k"]))
    until(lambda: bool(store._client.streams))
    for stream in list(store._client.streams):
        sock = stream.sock
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert [sock.getsockopt(socket.IPPROTO_TCP, o) for o in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL,
                                                                  socket.TCP_KEEPCNT)] == [20, 5, 2]
    store.clone().set("k", b"1")
    t.join(10)
    assert out == [None]


def test_every_member_gone_is_a_network_error(own_etcd_cluster: EtcdCluster) -> None:
    store = EtcdStore(own_etcd_cluster.url, fresh_job(), timeout=20)
    store.set("k", b"v")
    for member in range(3):
        own_etcd_cluster.kill(member)
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match="every member refused"):
        store.set("k", b"w")
    with pytest.raises(DistNetworkError, match="every member refused"):
        store.wait(["k2"])
    assert time.monotonic() - start < 5  # at once, not at the deadline


# --- answers lost in flight -----------------------------------------------------------------


class DroppingProxy:
    """A real TCP proxy to one member that forwards each request, waits until the
    member starts answering (so the request was applied), and then closes the
    client's connection without passing the answer on: a member lost in flight."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(client,), daemon=True).start()

    def _one(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.upstream) as member:
            client.settimeout(10)
            member.settimeout(10)
            request = b""
            while b"\r\n\r\n" not in request:
                request += client.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += client.recv(65536)
            member.sendall(head + b"\r\n\r\n" + body)
            if member.recv(1):  # the member answers: the request was applied
                self.dropped += 1

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not, on Linux)
        self.listener.close()


@pytest.fixture
def lossy(etcd_cluster: EtcdCluster) -> Iterator[tuple[EtcdStore, EtcdStore, DroppingProxy]]:
    """(a store whose first member is the dropping proxy, a plain store on the same job, the proxy)."""
    proxy = DroppingProxy(("127.0.0.1", etcd_cluster.client_ports[0]))
    job = fresh_job()
    plain = EtcdStore(etcd_cluster.url, job, timeout=20)
    endpoints = [f"127.0.0.1:{proxy.port}"] + etcd_cluster.endpoints[1:]
    store = EtcdStore(endpoints, job, timeout=20)
    yield store, plain, proxy
    store.close()
    plain.close()
    proxy.close()


def test_conditional_writes_sent_again_after_a_lost_answer_apply_once(
        lossy: tuple[EtcdStore, EtcdStore, DroppingProxy]) -> None:
    store, plain, proxy = lossy

    def through_proxy(call: Callable[[], object]) -> object:
        """Run ``call`` with the proxy as the first member: its answer is lost, the resend goes to the next."""
        before = proxy.dropped
        on_member(store, 0)
        result = call()
        assert proxy.dropped == before + 1 and store._client.current == 1
        return result

    plain.set("n", b"5")
    assert through_proxy(lambda: store.add("n", 3)) == 8
    assert plain.get("n") == b"8"
    assert through_proxy(lambda: store.add("fresh", 4)) == 4 and plain.get("fresh") == b"4"
    assert through_proxy(lambda: store.compare_set("n", b"8", b"nine")) == b"nine"
    assert through_proxy(lambda: store.compare_set("created", b"", b"c")) == b"c" and plain.get("created") == b"c"
    through_proxy(lambda: store.append("log", b"x"))
    through_proxy(lambda: store.append("log", b"y"))
    assert plain.get("log") == b"xy"
    through_proxy(lambda: store.queue_push("q", b"1"))
    assert plain.queue_len("q") == 1
    assert through_proxy(lambda: store.queue_pop("q")) == b"1"  # popped, and handed over, once
    assert plain.queue_len("q") == 0
    assert through_proxy(lambda: store.delete_key("log")) is True and not plain.check(["log"])
    through_proxy(lambda: store.set("s", b"S"))
    assert plain.get("s") == b"S"


def test_barrier_counts_an_arrival_sent_again_once(lossy: tuple[EtcdStore, EtcdStore, DroppingProxy]) -> None:
    store, plain, proxy = lossy
    t, out = start_thread(lambda: plain.barrier("b", 2, timeout=20))
    until(lambda: bool(plain._client.streams))  # the first arrival waits
    on_member(store, 0)
    store.barrier("b", 2, timeout=20)  # its arrival's answer is lost: the resend must not count twice
    t.join(20)
    assert out == [None] and proxy.dropped >= 1


# --- traffic -----------------------------------------------------------------------------------


def test_parked_waits_cost_no_requests(etcd_cluster: EtcdCluster) -> None:
    """A wait is a read and a watch, however long it parks (no polling)."""
    job = fresh_job()
    waiter, setter = EtcdStore(etcd_cluster.url, job, timeout=20), EtcdStore(etcd_cluster.url, job, timeout=20)
    cases = {"wait": (lambda: waiter.wait(["a", "b", "c"]), 3),  # a read, a watch of values, one of queues
             "get": (lambda: waiter.get("g"), 3),  # a read, a watch, the read of the value
             "queue_pop": (lambda: waiter.queue_pop("q"), 4)}  # a read, a watch, a read, the taking
    for name, (call, requests) in cases.items():
        before = waiter.requests
        t, out = start_thread(call)
        until(lambda: bool(waiter._client.streams))
        time.sleep(0.3)  # parked: nothing may happen meanwhile (the count below proves it)
        if name == "wait":
            for key in "abc":
                setter.set(key, b"1")
        elif name == "get":
            setter.set("g", b"G")
        else:
            setter.queue_push("q", b"Q")
        t.join(20)
        assert not t.is_alive() and not isinstance(out[0], Exception), (name, out)
        assert waiter.requests - before == requests, name


def test_barrier_is_one_request_per_caller(etcd_cluster: EtcdCluster) -> None:
    job, n = fresh_job(), 8
    stores = [EtcdStore(etcd_cluster.url, job, timeout=20) for _ in range(n)]
    assert [s.requests for s in stores] == [1] * n  # the constructor's check of the cluster's version
    threads = [start_thread(lambda s=s: s.barrier("b", n)) for s in stores]
    for t, out in threads:
        t.join(20)
        assert out == [None]
    # the arrival, then a watch for the release (or, for the last, the release)
    assert [s.requests - 1 for s in stores] == [2] * n


def test_concurrent_adds_are_exact(etcd_cluster: EtcdCluster) -> None:
    job, n, each = fresh_job(), 4, 20
    stores = [EtcdStore(etcd_cluster.url, job, timeout=20) for _ in range(n)]
    threads = [start_thread(lambda s=s: [s.add("c", 1) for _ in range(each)]) for s in stores]
    seen = []
    for t, out in threads:
        t.join(30)
        seen += out[0]  # type: ignore[arg-type]
    assert sorted(seen) == list(range(1, n * each + 1))  # every add saw a value of its own


# --- namespaces, init method, process group ---------------------------------------------------


def test_jobs_share_a_cluster_without_seeing_each_other(etcd_cluster: EtcdCluster) -> None:
    a, b = EtcdStore(etcd_cluster.url, fresh_job(), timeout=5), EtcdStore(etcd_cluster.url, fresh_job(), timeout=5)
    a.set("k", b"A")
    b.set("k", b"B")
    a.queue_push("q", b"a")
    assert (a.get("k"), b.get("k")) == (b"A", b"B")
    assert not b.check(["q"]) and b.queue_len("q") == 0
    assert a.num_keys() == b.num_keys() == 1
    assert b.delete_key("k") and a.get("k") == b"A"
    pa = PrefixStore("pg", a)
    pa.set("x", b"1")
    assert a.get("pg/x") == b"1" and a.list_keys() == ["k", "pg/x"]


def test_etcd_init_method(etcd_cluster: EtcdCluster) -> None:
    job = fresh_job()
    r0 = rendezvous(f"etcd://{etcd_cluster.url}/{job}", rank=0, world_size=2, timeout=10)
    r1 = rendezvous(f"etcd://{etcd_cluster.url}/{job}?rank=1&world_size=2", timeout=10)
    assert isinstance(r0.store, EtcdStore) and (r1.rank, r1.world_size) == (1, 2)
    assert r0.source == f"etcd://{etcd_cluster.url}/{job}"
    r0.store.set("hello", b"1")
    assert r1.store.get("hello") == b"1" and r1.store.timeout == 10
    for store in (r0.store, r1.store):
        store.close()
    for bad, message in [(f"etcd:///{job}", "expected etcd://host:port"), (f"etcd://{etcd_cluster.url}/", "job"),
                         (f"etcd://{etcd_cluster.url}/a/b", "without '/'"), ("etcd://h:port/j", "host:port")]:
        with pytest.raises(ValueError, match=message):
            rendezvous(bad, rank=0, world_size=1, timeout=1)


@pytest.mark.timeout(90)
def test_process_group_on_etcd(etcd_cluster: EtcdCluster, spawn: Callable[..., subprocess.Popen]) -> None:
    """Three processes form a host-backend group through etcd:// and all-reduce."""
    url = f"etcd://{etcd_cluster.url}/{fresh_job()}"
    code = ("import sys\nimport numpy as np\nimport nccl_pg as dist\n"
            "rank = int(sys.argv[2])\n"
            "dist.init_process_group('host', init_method=sys.argv[1], rank=rank, world_size=3, timeout=30)\n"
            "x = np.full(4, rank + 1.0)\ndist.all_reduce(x)\ndist.barrier()\n"
            "print(x.tolist(), flush=True)\ndist.destroy_process_group()\n")
    procs = [spawn(code, url, rank) for rank in range(3)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outputs == ["[6.0, 6.0, 6.0, 6.0]\n"] * 3


def test_host_backend_publishes_the_address_of_its_connection_to_etcd(etcd_cluster: EtcdCluster,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store = EtcdStore(etcd_cluster.url, fresh_job(), timeout=10)
    before = store.requests
    assert store.local_address() == "127.0.0.1" and store.requests == before  # no request needed
    [(sock, _)] = store._client.idle
    assert sock.getsockname()[0] == "127.0.0.1"
    monkeypatch.delenv("NCCL_PG_HOST_ADDR", raising=False)
    monkeypatch.setattr(EtcdStore, "local_address", lambda self: "192.0.2.7")  # as on a host with a real NIC
    assert host_address(PrefixStore("pg", store)) == "192.0.2.7"
    store.close()


# --- fork, close, errors ---------------------------------------------------------------------------


def test_forked_child_never_touches_the_parents_connections(etcd_cluster: EtcdCluster) -> None:
    store = EtcdStore(etcd_cluster.url, fresh_job(), timeout=10)
    store.set("parent", b"1")
    [(pooled, _)] = store._client.idle
    pid = os.fork()
    if pid == 0:  # the child: a connection of its own, its exit closes only its copies
        code = 1
        try:
            store.set("child", b"2")
            code = 0 if store.get("parent") == b"1" and pooled not in [s for s, _ in store._client.idle] else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get("child") == b"2"
    assert [s for s, _ in store._client.idle] == [pooled]  # the parent's connection survived the child
    store.close()


def test_close_wakes_a_blocked_wait(etcd_cluster: EtcdCluster) -> None:
    store = EtcdStore(etcd_cluster.url, fresh_job(), timeout=30)
    t, out = start_thread(lambda: store.wait(["never"]))
    until(lambda: bool(store._client.streams))
    start = time.monotonic()
    store.close()
    t.join(10)
    assert isinstance(out[0], DistStoreError) and "closed" in str(out[0])
    assert time.monotonic() - start < 5
    with pytest.raises(DistStoreError, match="closed"):
        store.get("k")


def test_value_over_etcds_request_limit_is_a_value_error(etcd_cluster: EtcdCluster) -> None:
    store = EtcdStore(etcd_cluster.url, fresh_job(), timeout=10)
    with pytest.raises(ValueError, match="max-request-bytes"):
        store.set("big", b"x" * (2 << 20))
    store.set("small", b"x" * 1000)  # the store still works
    assert store.get("small") == b"x" * 1000
    store.close()


def test_unreachable_cluster_is_a_network_error_within_connect_timeout() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=r"timeout: no etcd member .* within"):
        EtcdStore(f"127.0.0.1:{port}", "j", timeout=30, connect_timeout=0.5)
    assert time.monotonic() - start < 3


def test_bad_arguments() -> None:
    for endpoints in ("", "h", "h:x", "https://h:1", ["h:1", 3]):
        with pytest.raises(ValueError, match="etcd endpoint"):
            EtcdStore(endpoints, "j")  # type: ignore[arg-type]
    for job in ("", "a/b", "tab\t"):
        with pytest.raises(ValueError, match="job name"):
            check_job(job)
    with pytest.raises(TypeError, match="job name must be str"):
        check_job(3)


def test_import_nccl_pg_does_not_load_the_etcd_client() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, nccl_pg, nccl_pg.store.rendezvous\n"
                          "print('nccl_pg.store.etcd_client' in sys.modules)"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout == "False\n"


@pytest.mark.timeout(180)
def test_benchmark_tool_runs_and_barrier_is_constant_per_client(etcd_cluster: EtcdCluster) -> None:
    """tools/bench_etcd_store.py (docs/BENCHMARKS.md) on a small case: it runs, and EtcdStore's
    barrier rendezvous costs each client the same 5 requests whatever N."""
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "bench_etcd_store.py")
    out = subprocess.run([sys.executable, tool, "--sizes", "2", "8", "--repeats", "1", "--ops", "5"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    rows: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in ("2/barrier", "8/barrier", "2/add", "8/add"):
            rows[parts[0]] = parts
    assert set(rows) == {"2/barrier", "8/barrier", "2/add", "8/add"}, out.stdout
    assert float(rows["2/barrier"][-1]) == float(rows["8/barrier"][-1]) == 5.0
