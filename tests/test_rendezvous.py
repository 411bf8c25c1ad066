"""Init methods: env:// under each launcher's variables, tcp://, file://, and
their validation errors."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

from nccl_pg import DistStoreError, Rendezvous, TCPStoreServer, rendezvous
from nccl_pg.store.rendezvous import first_host


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world_size: int, make: Callable[[int], Rendezvous]) -> list[tuple[int, int, int | None, str, list[bytes]]]:
    """Each rank (a thread) rendezvouses, publishes its rank and reads everyone's."""
    results: list = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(i: int) -> None:
        try:
            r = make(i)
            with r.store:
                r.store.set(f"hello/{r.rank}", str(r.rank))
                seen = r.store.multi_get([f"hello/{j}" for j in range(r.world_size)])
                if r.store.add("left", 1) == r.world_size:
                    r.store.set("all_left", "1")
                if r.rank == 0:  # rank 0 may host the server: it leaves last
                    r.store.wait(["all_left"])
                results[i] = (r.rank, r.world_size, r.local_rank, r.source, seen)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(i,)) for i in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


def expect_all(results: list, world_size: int, source: str) -> None:
    assert sorted(r[0] for r in results) == list(range(world_size))
    for _rank, size, _, src, seen in results:
        assert size == world_size and src == source
        assert seen == [str(j).encode() for j in range(world_size)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "source, make_env",
    [
        ("torchrun-style", lambda r, n: {"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r)}),
        ("SLURM", lambda r, n: {"SLURM_PROCID": str(r), "SLURM_NTASKS": str(n), "SLURM_LOCALID": str(r),
                                "SLURM_STEP_NODELIST": "localhost"}),
        ("Open MPI", lambda r, n: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(n),
                                   "OMPI_COMM_WORLD_LOCAL_RANK": str(r)}),
        ("MPICH/PMI", lambda r, n: {"PMI_RANK": str(r), "PMI_SIZE": str(n)}),
    ],
)
def test_env_rendezvous_under_each_launcher(source: str, make_env: Callable[[int, int], dict[str, str]]) -> None:
    port = free_port()
    common = {"MASTER_PORT": str(port)}
    if source != "SLURM":  # SLURM finds its master in the node list
        common["MASTER_ADDR"] = "127.0.0.1"
    results = run_ranks(3, lambda r: rendezvous("env://", timeout=20, environ={**common, **make_env(r, 3)}))
    expect_all(results, 3, source)
    if source != "MPICH/PMI":
        assert all(rank == local for rank, _, local, _, _ in results)


@pytest.mark.timeout(30)
def test_env_rendezvous_with_agent_store_and_secret() -> None:
    """Under `nccl-pg run` the launcher hosts the store: rank 0 is a client too."""
    with TCPStoreServer("127.0.0.1", 0, secret="s3cret") as server:
        server.start()
        environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "WORLD_SIZE": "2",
                   "NCCL_PG_USE_AGENT_STORE": "1", "NCCL_PG_STORE_SECRET": "s3cret"}
        results = run_ranks(2, lambda r: rendezvous(environ={**environ, "RANK": str(r)}, timeout=20))
        expect_all(results, 2, "torchrun-style")


@pytest.mark.timeout(30)
def test_tcp_init_method_with_query_and_arguments() -> None:
    port = free_port()
    results = run_ranks(3, lambda r: rendezvous(f"tcp://127.0.0.1:{port}?world_size=3", rank=r, timeout=20))
    expect_all(results, 3, f"tcp://127.0.0.1:{port}")


@pytest.mark.timeout(60)
def test_file_init_method_across_processes(tmp_path) -> None:
    path = tmp_path / "rdzv"
    code = (
        "import sys; from nccl_pg import rendezvous\n"
        f"r = rendezvous('file://{path}', rank=int(sys.argv[1]), world_size=3, timeout=30)\n"
        "r.store.set(f'k{r.rank}', str(r.rank)); print(r.store.multi_get(['k0', 'k1', 'k2']))\n"
        "if r.store.add('n', 1) == 3: r.store.set('done', '1')\n"
        "r.store.wait(['done']); r.store.close()\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, text=True)
             for i in range(3)]
    outs = [p.communicate(timeout=50)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert all(o.strip() == "[b'0', b'1', b'2']" for o in outs)
    assert not path.exists()  # the last user removed the file


@pytest.mark.timeout(30)
def test_master_times_out_naming_missing_workers() -> None:
    with pytest.raises(DistStoreError, match=r"timeout: only 1 of 2 workers"):
        rendezvous(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=2, timeout=0.5)


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234"}, "MASTER_ADDR is not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not set"),
        ({"RANK": "abc", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, r"RANK='abc' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, r"WORLD_SIZE='0' is out of range"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, r"MASTER_PORT='70000'"),
        ({"RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "WORLD_SIZE is not set"),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK is not set"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "rank 2 is out of range"),
        ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, r"SLURM_PROCID='x'"),
        ({}, "no launcher variables found"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1", "NCCL_PG_STORE_TIMEOUT": "soon"},
         "NCCL_PG_STORE_TIMEOUT"),
    ],
)
def test_env_validation_names_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rendezvous("env://", environ=environ)


@pytest.mark.parametrize(
    "url, message",
    [
        ("redis://h:1", "unsupported scheme"),
        ("tcp://127.0.0.1", "expected tcp://host:port"),
        ("tcp://127.0.0.1:1?rank=zero&world_size=2", "rank='zero' is not an integer"),
        ("tcp://127.0.0.1:1?rank=0", "world_size must be given"),
    ],
)
def test_init_method_validation(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rendezvous(url, environ={})


def test_argument_types() -> None:
    with pytest.raises(TypeError, match="rank must be an int"):
        rendezvous("tcp://h:1", rank="0", world_size=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be a finite duration"):
        rendezvous("tcp://h:1", rank=0, world_size=1, timeout=-1)


@pytest.mark.parametrize(
    "nodelist, host",
    [("node7", "node7"), ("gpu[03-05,9],cpu1", "gpu03"), ("a[1,2]", "a1"), ("rack[2-3]-n", "rack2-n"),
     ("x1,x2", "x1")],
)
def test_slurm_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host
