"""`import shardnorm` stops on a torch or Triton older than the floors (versions.py), naming the installed and
the needed version."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardnorm import versions

ROOT = Path(__file__).resolve().parents[1]


def test_release_reads_major_and_minor():
    assert versions.release("2.11.0+cu130") == (2, 11)
    assert versions.release("2.13.0a0+git1234abc") == (2, 13)
    assert versions.release("3.6.0.dev20260101") == (3, 6)
    assert versions.release("10.0") == (10, 0)  # numbers, not strings: "10.0" < "2.11" as text
    with pytest.raises(ImportError, match="'nightly'"):
        versions.release("nightly")


@pytest.mark.parametrize("package, floor", [("torch", versions.TORCH_FLOOR), ("triton", versions.TRITON_FLOOR)])
def test_check_names_installed_and_needed(package, floor):
    major, minor = floor
    versions.check(package, f"{major}.{minor}.0", floor)  # the floor itself is supported
    versions.check(package, f"{major}.{minor + 1}.0+local", floor)
    with pytest.raises(ImportError) as error:
        versions.check(package, f"{major}.{minor - 1}.9", floor)
    assert f"{package}>={major}.{minor}" in str(error.value) and f"{package} {major}.{minor - 1}.9" in str(error.value)


def test_installed_stack_passes():
    versions.check_installed()
    assert versions.installed_triton() is not None  # the stack the suite runs on has Triton


def test_check_installed_reads_torch_and_triton(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.1")
    with pytest.raises(ImportError, match=r"torch>=2\.11, but torch 2\.10\.1 is installed"):
        versions.check_installed()
    monkeypatch.undo()
    monkeypatch.setattr(versions, "installed_triton", lambda: "3.5.0")
    with pytest.raises(ImportError, match=r"triton>=3\.6, but triton 3\.5\.0 is installed"):
        versions.check_installed()


# `import shardnorm` in a fresh interpreter whose torch / Triton report an older release: the package root
# must run the check before anything else
_IMPORT_WITH = {
    "torch": "import torch; torch.__version__ = '2.10.0'",
    "triton": "import importlib.metadata as m; real = m.version; "
              "m.version = lambda d: '3.5.1' if d == 'triton' else real(d)",
}


@pytest.mark.parametrize("package", sorted(_IMPORT_WITH))
def test_import_stops_on_an_old_release(package):
    code = f"{_IMPORT_WITH[package]}; import shardnorm"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True, capture_output=True,
                            timeout=1800)  # a hang, not speed
    assert result.returncode != 0, result.stdout + result.stderr
    assert "ImportError: shardnorm needs " + package + ">=" in result.stderr, result.stderr[-2000:]
