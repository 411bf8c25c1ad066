"""Elastic recovery for a training loop: what a loop needs to go on when
ranks die or hang, and to take replacements and new nodes in
(docs/ELASTIC.md)::

    job = elastic.Elastic.from_env()          # under `nccl-pg run --elastic`
    rec = job.start("host")                   # the original ranks: init; a replacement: comes in
    while step < steps:
        try:
            job.broadcast_state(arrays)       # after a start or recovery that needs it; else nothing
            ...collectives of one step...; step += 1
        except nccl_pg.DistBackendError as exc:
            rec = job.recover(step, exc)      # raises DistBackendError when no attempt works in time
            ...roll back to rec.step (the next step's job.broadcast_state(arrays) sends the state if needed)

The pieces: the membership records in the job's store (records.py), the
recovery's attempts (recovery.py), the watch that revokes a group when a
newer record appears (watch.py).
"""

from .records import LATEST_KEY, NAMESPACE, Config, Records, config_key, slot_key
from .recovery import Change, Elastic, Recovery

__all__ = ["LATEST_KEY", "NAMESPACE", "Change", "Config", "Elastic", "Records", "Recovery", "config_key",
           "slot_key"]
