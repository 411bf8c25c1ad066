"""examples/elastic.py with faults put inside a recovery, for tests that run
it under `nccl-pg run --elastic` (tests/test_elastic_recovery.py):

    nccl-pg run --elastic tests/harness/elastic_faults.py [example's arguments]

``NCCL_PG_TEST_FAULT`` says which member does what (a list, ``;``-separated):

- ``offered:M``: member M SIGKILLs itself right after it put its handle in
  a configuration's slot (inside its first recovery or start): a death
  during a recovery, after the others may have seen it come;
- ``grow:M``: member M SIGKILLs itself 50 ms into its first reconfigure (a
  replacement: inside the grow that takes it in);
- ``transfer:M``: member M (a replacement) writes a newer configuration (its
  own members again, as any change would) just before the state is sent to
  it, and waits until its record watch revoked its group: the transfer
  fails (what it left in the arrays is scribbled over), and the recovery
  after it must send the state again.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import elastic as example  # noqa: E402  (examples/elastic.py)

from nccl_pg import DistBackendError  # noqa: E402
from nccl_pg.elastic import records, recovery  # noqa: E402
from nccl_pg.membership import job_store  # noqa: E402


def _die(why: str) -> None:
    print(f"member {os.environ.get('NCCL_PG_ELASTIC_MEMBER')}: SIGKILL {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _install(faults: list[tuple[str, int]]) -> None:
    me = int(os.environ["NCCL_PG_ELASTIC_MEMBER"])
    kinds = {kind for kind, member in faults if member == me}
    if "offered" in kinds:
        offer = records.Records.offer

        def offer_then_die(self, config, member, handle):  # type: ignore[no-untyped-def]
            offer(self, config, member, handle)
            _die(f"after its handle went into configuration {config.uuid}")

        records.Records.offer = offer_then_die  # type: ignore[method-assign]
    if "grow" in kinds:
        reconfigure = recovery.reconfigure

        def reconfigure_then_die(*args, **kwargs):  # type: ignore[no-untyped-def]
            threading.Timer(0.05, _die, (f"inside its reconfigure to configuration {args[0]}",)).start()
            return reconfigure(*args, **kwargs)

        recovery.reconfigure = reconfigure_then_die  # type: ignore[assignment]
    if "transfer" in kinds:
        send = recovery.Elastic.broadcast_state
        first = [True]

        def change_then_send(self, arrays):  # type: ignore[no-untyped-def]
            if first[0]:  # a replacement's first call: the state is to come to it
                first[0] = False
                new = records.Records(job_store()).write_next(lambda c: c.members,
                                                             "test: a change as the state is sent")
                print(f"member {me}: wrote configuration {new.uuid} before the state came", flush=True)
                limit = time.monotonic() + 10
                while self.watch is not None and not self.watch.fired and time.monotonic() < limit:
                    time.sleep(0.01)
                if self.watch is None or not self.watch.fired:  # the case would not be the one asked for
                    raise RuntimeError(f"member {me}: its record watch did not revoke the group within 10 s")
                try:
                    return send(self, arrays)
                except DistBackendError:
                    # What a failed transfer left in the arrays is undefined (the host backend may have written
                    # all of it, NCCL part): scribbled over, so that only a transfer sent again can give the state.
                    for a in arrays:
                        a[...] = -1
                    raise
            return send(self, arrays)

        recovery.Elastic.broadcast_state = change_then_send  # type: ignore[method-assign]


if __name__ == "__main__":
    spec = os.environ.get("NCCL_PG_TEST_FAULT", "")
    _install([(k, int(m)) for k, _, m in (f.partition(":") for f in spec.split(";") if f)])
    sys.exit(example.main())
