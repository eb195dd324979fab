"""The wheel a user installs holds every file of the package.

``pip install .`` (not editable) or a built wheel takes only what ``pyproject.toml`` names: Python
files of directories with an ``__init__.py``, and the data files ``[tool.setuptools.package-data]``
lists. A data file it misses is missing only after an install, never in this checkout: until
stop 78 the wheel left out ``plan/host_cost.json`` -- the planner's host cost, which
``scripts/gpu_check.sh`` measures and a user copies there -- so an installed planner priced
:mod:`megatron_mesh.plan.hostcost`'s built-in number instead, whatever the file said.
"""

import os
import shutil
import subprocess
import sys
import zipfile

from helpers import ROOT

PACKAGE = os.path.join(ROOT, "megatron_mesh")


def _package_files() -> set[str]:
    """Every file of the package in this checkout, relative to the repository (no bytecode)."""
    out = set()
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".pyc"):
                out.add(os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/"))
    return out


def test_the_wheel_holds_every_file_of_the_package(tmp_path):
    """Build the wheel from a copy of what it is built from (the build writes its own folders there,
    not into the checkout) and compare its files with the package's."""
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "megatron_mesh", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").iterdir()
    with zipfile.ZipFile(wheel) as z:
        packed = {n for n in z.namelist() if n.startswith("megatron_mesh/")}
        entry_points = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    missing = sorted(_package_files() - packed)
    assert not missing, f"pyproject.toml leaves these out of the wheel (package-data or an __init__.py): {missing}"
    assert "plan/host_cost.json" in " ".join(packed)
    assert "megatron-mesh-plan = megatron_mesh.tools.plan_cli:main" in entry_points
