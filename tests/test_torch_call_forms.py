"""Every call form of torch 2.13's ProcessGroup methods (issue 31, item 4).

The forms come from torch's own stub, torch/_C/_distributed_c10d.pyi, read
from the installed wheel: each overload of each method the "nccl_pg" group
defines must bind to our method, its arguments given by position and by
name. tests/test_torch_dropin.py::test_every_call_form_through_a_group has
two ranks call every form through a group (the bare ReduceOp of torchft's
wrapper included) and check the values.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need PyTorch (pip install torch)")
from nccl_pg.torch.process_group import ProcessGroupTorch  # noqa: E402

pytestmark = pytest.mark.timeout(30)

# The collectives and point-to-point methods torch's ProcessGroup has (its stub's names); the test fails if
# torch's stub loses one (then this list is out of date) or ours lacks one.
COLLECTIVES = {
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single", "_allgather_base",
    "allgather_coalesced", "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "alltoall_base", "alltoall", "send", "recv",
    "recv_anysource", "barrier",
}


def _stub_overloads() -> dict[str, list[ast.arguments]]:
    """ProcessGroup's methods in torch's stub: name -> the arguments of each overload."""
    stub = Path(torch.__file__).parent / "_C" / "_distributed_c10d.pyi"
    tree = ast.parse(stub.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ProcessGroup")
    out: dict[str, list[ast.arguments]] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            out.setdefault(node.name, []).append(node.args)
    return out


def test_every_overload_of_torchs_stub_binds() -> None:
    overloads = _stub_overloads()
    assert COLLECTIVES <= set(overloads), sorted(COLLECTIVES - set(overloads))
    checked = 0
    for name, forms in overloads.items():
        ours = ProcessGroupTorch.__dict__.get(name)
        if name in COLLECTIVES:
            assert callable(ours), f"ProcessGroupTorch has no {name}"
        if not callable(ours) or name.startswith("__"):
            continue  # torch's own C++ method serves it (and torch's creator, not users, constructs ours)
        sig = inspect.signature(ours)
        for args in forms:
            params = [a.arg for a in args.posonlyargs + args.args][1:]  # without self
            params += [a.arg for a in args.kwonlyargs]
            required = len(args.args) - 1 - len(args.defaults)
            for how, given, named in (("by position", params, {}), ("by name", [], dict.fromkeys(params)),
                                      ("without the defaults", params[:required], {})):
                try:
                    sig.bind(None, *given, **named)
                except TypeError as exc:
                    raise AssertionError(f"{name}({', '.join(params)}) {how}: {exc}") from None
            checked += 1
    assert checked >= 40, checked
