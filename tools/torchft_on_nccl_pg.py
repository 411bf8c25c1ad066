"""A pytest plugin (``-p torchft_on_nccl_pg``, tools/ on the path): torchft's
own tests with nccl_pg's adapter wherever they use torchft's Gloo groups —
``ProcessGroupGloo`` becomes ``nccl_pg.torch.torchft.ProcessGroupNcclPg`` and
``ProcessGroupBabyGloo`` becomes ``ProcessGroupBabyNcclPg``, in every torchft
module that names them, before pytest imports the test modules (which
import them by name). Used by tools/torchft_suite.py.
"""

from __future__ import annotations

import torchft
import torchft.ddp
import torchft.process_group

from nccl_pg.torch.torchft import ProcessGroupBabyNcclPg, ProcessGroupNcclPg

for _module in (torchft, torchft.process_group, torchft.ddp):
    if hasattr(_module, "ProcessGroupGloo"):
        _module.ProcessGroupGloo = ProcessGroupNcclPg  # type: ignore[attr-defined]
    if hasattr(_module, "ProcessGroupBabyGloo"):
        _module.ProcessGroupBabyGloo = ProcessGroupBabyNcclPg  # type: ignore[attr-defined]
