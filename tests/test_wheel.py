"""Install from a wheel, as a user without a checkout would (README: "Install"): `python -m build` makes the
sdist and, from it, the wheel; `pip install 'nccl_pg-*.whl[torch]'` installs it into a scratch virtual
environment. What the package needs at run time is there: the CUDA kernels' sources (nccl_pg/_kernels), the
browser view's page (nccl_pg/cli/ui_page), the `nccl-pg` command, the pytest plugin, and torch's
`torch.backends` entry point, which registers the "nccl_pg" backend at `import torch` with no import of nccl_pg.

Lean and offline: the build runs without isolation on this environment's setuptools, and the scratch
environment sees this environment's packages (a .pth line) so that pip resolves the dependencies and extras
from them with --no-index; the scratch environment's own nccl_pg, the wheel's, comes first on its path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the sdist is built from: the package's metadata, sources and kernels (the sdist holds what the wheel needs,
# or the wheel built from it lacks it).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "nccl_pg", "kernels")

CHECK = """
import importlib.metadata as md, json, sys
import nccl_pg
from nccl_pg import kernels
dist = md.distribution("nccl_pg")
print(json.dumps({
    "package": nccl_pg.__file__,
    "dist": str(dist.locate_file("")),
    "kernels": {p.name: p.read_text() for p in kernels.source_path(kernels.NAN_CHECK).parent.glob("*.cu")},
    "entry_points": sorted(f"{e.group}:{e.name}={e.value}" for e in dist.entry_points),
    "torch_backends": [e.value for e in md.entry_points(group="torch.backends", name="nccl_pg")],
    "torch_before": "torch" in sys.modules,
    "ui_page": sorted(p.name for p in (md.files("nccl_pg") or []) if p.parent.name == "ui_page"),
}))
# torch's entry point registers the backend at `import torch`: nothing here imports nccl_pg.torch.
import torch.distributed as tdist
print(json.dumps({"plugins": sorted(tdist.Backend._plugins), "module": sys.modules["nccl_pg.torch"].__file__}))
"""


def run(cmd: list[str], timeout: float, cwd: Path) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.timeout(240)
def test_the_wheel_installs_with_its_kernels_command_and_torch_entry_point(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(ROOT / name, src / name)
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(src)], 120, tmp_path)
    wheels = list((tmp_path / "dist").glob("nccl_pg-*.whl"))
    assert len(wheels) == 1 and list((tmp_path / "dist").glob("nccl_pg-*.tar.gz")), wheels

    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 30, tmp_path)
                .strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "outer.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "-q",
         f"{wheels[0]}[torch]"], 120, tmp_path)

    # -I: no current directory, PYTHONPATH or user site on the path: the checkout cannot stand in for the wheel.
    got, torch = map(json.loads, run([str(python), "-I", "-c", CHECK], 90, tmp_path).splitlines())
    assert got["package"] == str(site / "nccl_pg" / "__init__.py")
    assert Path(got["dist"]) == site
    assert got["kernels"] == {p.name: p.read_text() for p in (ROOT / "kernels").glob("*.cu")} != {}
    assert got["entry_points"] == ["console_scripts:nccl-pg=nccl_pg.cli.main:main",
                                   "pytest11:nccl_pg=nccl_pg.testing.pytest_plugin",
                                   "torch.backends:nccl_pg=nccl_pg.torch:_autoload"]
    assert got["torch_backends"] == ["nccl_pg.torch:_autoload"] and not got["torch_before"]
    assert got["ui_page"] == sorted(p.name for p in (ROOT / "nccl_pg" / "cli" / "ui_page").iterdir())  # the job's page
    assert "NCCL_PG" in torch["plugins"] and torch["module"] == str(site / "nccl_pg" / "torch" / "__init__.py")
    assert "usage: nccl-pg" in run([str(env / "bin" / "nccl-pg"), "--help"], 60, tmp_path)
    # nccl_pg.torch as a program's first import of torch (torch runs the entry point while it loads)
    assert run([str(python), "-I", "-c", "import nccl_pg.torch, torch.distributed as t; print(t.is_backend_available"
                "('nccl_pg'))"], 90, tmp_path).strip() == "True"
