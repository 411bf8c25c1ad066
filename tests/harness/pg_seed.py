"""What the test_pg_*.py files (ported from the seed test_c10d_nccl.py)
share: the backend parametrizations and the world they run a scenario on.

Each test runs its seed's scenario on a world of real processes (2 or 4, as
the seed does) that rendezvous over a FileStore, on the host backend; the
``nccl`` variants run the same scenario on a GPU machine. A scenario is a
module-level ``_s_*`` function run by every rank (see harness/forked.py);
plain ``assert``s in it fail the test with that rank's traceback.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from harness.forked import run_world
from nccl_pg.distributed import GroupMember

BACKENDS = pytest.mark.parametrize("backend", ["host", pytest.param("nccl", marks=pytest.mark.gpu)])
NCCL_ONLY = pytest.mark.parametrize("backend", [pytest.param("nccl", marks=pytest.mark.gpu)])
NON_MEMBER = GroupMember.NON_GROUP_MEMBER
TEN_MINUTES = timedelta(minutes=10)
FP8_REDUCTION = "Float8 dtypes are not .*supported for NCCL reductions"


def world(scenario: Any, n: int, tmp_path: Any, backend: str, env: dict[str, str] | None = None,
          **kwargs: Any) -> list[Any]:
    return run_world(scenario, n, tmp_path, backend=backend, env=env, timeout=45, **kwargs)
