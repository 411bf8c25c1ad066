"""`nccl-pg run --elastic`: ranks that die are replaced, hung ones too, and
the job goes on; with one launcher per node meeting on etcd, a lost node's
ranks are left behind and a node started again brings its ranks back.

The launcher writes the membership records of nccl_pg.elastic (records.py)
for what only it sees: its ranks' deaths (it reaps them) and their
replacements. At start, record 0: every rank of every node (member number =
global rank). When its ranks die — all those reaped in one pass of its loop
together, as when a node's GPUs fail at once — it writes the next
configuration without them and marks them gone in the recent ones (so that a
recovery waiting for them ends at once), then starts a replacement for each
while ``--max-replacements`` allows: a new member number, the dead rank's
LOCAL_RANK (its GPU), no RANK; the replacement writes its own record when it
is ready (the others take it in then, without waiting for its start). With
too few replacements left, a death stops the job as without --elastic.

Hung ranks: the survivors report the ranks their timed-out operation named
(elastic_stuck.py decides from the report, takes the rank's stack, and has
the launcher stop it and replace it like a dead one).

Several nodes (``--nnodes``, ``--node-rank`` or none: the next free one,
``--rdzv-endpoint``, ``--rdzv-id``, named after torchrun's): the store is an
etcd cluster, which outlives any node; each launcher starts its ranks with
RANK = node rank * nproc + local rank, replaces only its own, and a launcher
that starts when its node's first incarnation has come and gone (its node
rank taken, or more nodes than --nnodes) starts its ranks as new processes,
which the running ranks take in. A node that is lost with its launcher is
left behind by the others: its ranks do not come to the next configuration,
and after one attempt the survivors go on without them.
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass

from .. import env
from ..elastic.records import Records
from ..store import Store, TCPStore
from ..store.etcd_client import parse_endpoints

DEFAULT_MAX_REPLACEMENTS = 3
NODES_KEY = "nccl_pg/elastic/nodes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--elastic", action="store_true",
                        help="replace a rank that dies or hangs with a new process, which the others take in "
                             "(nccl_pg.elastic; docs/ELASTIC.md)")
    parser.add_argument("--max-replacements", type=_count, default=DEFAULT_MAX_REPLACEMENTS, metavar="N",
                        help="with --elastic: start at most N replacements (on this node, in the whole job), then a "
                             f"death stops the job (default: {DEFAULT_MAX_REPLACEMENTS})")
    parser.add_argument("--no-replace-stuck", dest="replace_stuck", action="store_false",
                        help="with --elastic: leave hung ranks alone. By default a rank named stuck (no progress "
                             "past a timeout: the others' operation timeout names it, as the diagnosis says, or it "
                             "did not come to a recovery for a whole attempt) has its stack taken, then is stopped "
                             "and replaced like a dead one")
    parser.add_argument("--nnodes", type=_positive, default=1, metavar="N",
                        help="with --elastic: the job's nodes, one launcher each, meeting on --rdzv-endpoint "
                             "(default: 1)")
    parser.add_argument("--node-rank", type=_count, default=None, metavar="R",
                        help="with --nnodes: this node's number, 0..N-1 (default: the next free one in the "
                             "rendezvous); a launcher whose node rank was taken before starts its ranks as new ones, "
                             "which the running job takes in")
    parser.add_argument("--rdzv-backend", choices=("etcd",), default="etcd",
                        help="with --nnodes: the store the nodes meet on (etcd, which outlives any node)")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT[,HOST:PORT...]",
                        help="with --nnodes: the etcd cluster's members")
    parser.add_argument("--rdzv-id", metavar="JOB",
                        help="with --nnodes: the job's name in the etcd cluster (every node's launcher gives the same)")


def _count(raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {raw!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(raw: str) -> int:
    value = _count(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class ElasticOptions:
    max_replacements: int = DEFAULT_MAX_REPLACEMENTS
    replace_stuck: bool = True
    nnodes: int = 1
    node_rank: int | None = None
    endpoint: str | None = None  # etcd members: several nodes
    job: str | None = None

    @property
    def store_url(self) -> str | None:
        return None if self.endpoint is None else f"etcd://{self.endpoint}/{self.job}"


def options_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ElasticOptions | None:
    """The --elastic options (None without --elastic); bad combinations end with a usage error."""
    multi = args.nnodes > 1 or args.node_rank is not None or args.rdzv_endpoint or args.rdzv_id
    if not args.elastic:
        if multi:
            parser.error("--nnodes, --node-rank, --rdzv-endpoint and --rdzv-id go with --elastic")
        return None
    if multi:
        if not args.rdzv_endpoint or not args.rdzv_id:
            parser.error("several nodes (--nnodes, --node-rank) meet on an etcd cluster: give --rdzv-endpoint "
                         "HOST:PORT[,...] and --rdzv-id JOB")
        try:
            parse_endpoints(args.rdzv_endpoint.removeprefix("etcd://"))
            env.parse_etcd_url(f"etcd://{args.rdzv_endpoint.removeprefix('etcd://')}/{args.rdzv_id}")
        except ValueError as exc:
            parser.error(f"--rdzv-endpoint/--rdzv-id: {exc}")
        if args.node_rank is not None and args.node_rank >= args.nnodes:
            parser.error(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}")
    return ElasticOptions(args.max_replacements, args.replace_stuck, args.nnodes, args.node_rank,
                          args.rdzv_endpoint.removeprefix("etcd://") if args.rdzv_endpoint else None, args.rdzv_id)


@dataclass(frozen=True)
class Start:
    """A rank to start: its member number (its label) and what its environment adds."""

    member: int
    env: dict[str, str]


class Membership:
    """This launcher's side of the records: which ranks it starts, what a
    death of its ranks writes, and their replacements."""

    def __init__(self, opts: ElasticOptions, nproc: int, store: Store) -> None:
        self.opts, self.nproc, self.store = opts, nproc, store
        self.records = Records(store)
        self.world = opts.nnodes * nproc
        self.replacements_left = opts.max_replacements
        self.local_rank: dict[int, int] = {}  # member -> its LOCAL_RANK on this node
        self.node: int | None = None  # this launcher's node rank (None: it came in after the job started)

    @classmethod
    def open(cls, opts: ElasticOptions, nproc: int, addr: str, port: int, secret: str | None,
             timeout: float = 30.0) -> Membership:
        """On the job's store: etcd for several nodes, else the launcher's own server."""
        if opts.store_url is not None:
            from ..store.rendezvous import etcd_store_of  # noqa: PLC0415 - only jobs on etcd load its client

            return cls(opts, nproc, etcd_store_of(opts.store_url, timeout))
        return cls(opts, nproc, TCPStore(addr, port, is_master=False, timeout=timeout, secret=secret))

    def common_env(self) -> dict[str, str]:
        """What every rank of this launcher gets (several nodes: the job's store)."""
        out = {"WORLD_SIZE": str(self.world)}
        if self.opts.store_url is not None:
            out[env.ELASTIC_STORE.name] = self.opts.store_url
        return out

    def initial(self) -> list[Start]:
        """The ranks to start now: this node's original ranks, or, on a node
        that comes in while the job runs, new processes the job takes in."""
        node = self._claim_node()
        if node is not None:
            self.node = node
            self.records.start(range(self.world))
            members = [node * self.nproc + i for i in range(self.nproc)]
            self.local_rank = {m: i for i, m in enumerate(members)}
            return [Start(m, {"RANK": str(m), "LOCAL_RANK": str(i), "GROUP_RANK": str(node),
                              env.ELASTIC_MEMBER.name: str(m)}) for i, m in enumerate(members)]
        members = self.records.new_members(self.world, self.nproc)
        latest = self.records.latest()
        self.local_rank = {m: i for i, m in enumerate(members)}
        return [Start(m, {"LOCAL_RANK": str(i), env.ELASTIC_MEMBER.name: str(m), env.ELASTIC_UUID.name: str(latest)})
                for i, m in enumerate(members)]

    def _claim_node(self) -> int | None:
        """This launcher's node rank when it is the node's first incarnation, else None."""
        if self.opts.store_url is None:
            return 0
        if self.opts.node_rank is None:
            n = self.store.add(f"{NODES_KEY}/count", 1) - 1
            return n if n < self.opts.nnodes else None
        token = secrets.token_hex(8).encode()
        key = f"{NODES_KEY}/{self.opts.node_rank}"
        return self.opts.node_rank if self.store.compare_set(key, b"", token) == token else None

    def died(self, dead: dict[int, str]) -> list[Start] | None:
        """Members ``dead`` ({member: how it ended}) of this launcher died
        together: the next configuration without them, their slots marked
        gone, and a replacement for each (None, with nothing written, when
        too few replacements are left: the job stops)."""
        if len(dead) > self.replacements_left:
            return None
        self.replacements_left -= len(dead)
        gone = set(dead)
        why = "; ".join(f"member {m} {how}" for m, how in sorted(dead.items()))
        written = self.records.write_next(lambda c: [m for m in c.members if m not in gone]
                                          if gone & set(c.members) else None, f"died: {why} (its launcher saw it)")
        upto = written.uuid - 1 if written is not None else self.records.latest()
        self.records.tombstone(sorted(gone), f"died ({why})", upto)
        latest = written.uuid if written is not None else upto
        out = []
        for old, new in zip(sorted(dead), self.records.new_members(self.world, len(dead)), strict=True):
            local = self.local_rank.pop(old, 0)
            self.local_rank[new] = local
            out.append(Start(new, {env.ELASTIC_MEMBER.name: str(new), env.ELASTIC_UUID.name: str(latest),
                                   "LOCAL_RANK": str(local)}))
        return out

    def close(self) -> None:
        self.store.close()

