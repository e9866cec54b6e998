"""scripts/install.py (`make install`): each step announced, and a line whenever pip has been silent
for `--quiet-s` seconds. Fake slow commands stand in for pip: nothing is installed, no network."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def install():
    spec = importlib.util.spec_from_file_location("install_script", ROOT / "scripts" / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SLOW = "import sys, time; print('Installing collected packages: torch', flush=True); time.sleep(2.6); print('Successfully installed torch')"


def test_a_silent_command_gets_a_line_while_it_is_silent(install):
    out = io.BytesIO()
    rc = install.run_watched([sys.executable, "-c", SLOW + "; sys.exit(3)"], quiet_s=1.0, out=out)
    text = out.getvalue().decode()
    assert rc == 3  # the command's own exit code
    first, last = text.index("Installing collected packages"), text.index("Successfully installed")
    beats = [ln for ln in text[first:last].splitlines() if "still" in ln]
    assert 1 <= len(beats) <= 3, text  # ~2.6 s of silence, a line per second at most
    assert all("make install: ... pip is still unpacking and byte-compiling the wheels" in b for b in beats)


def test_a_chatty_command_gets_no_extra_line(install):
    chatty = "import time\nfor i in range(6):\n    print(i, flush=True); time.sleep(0.3)"
    out = io.BytesIO()
    assert install.run_watched([sys.executable, "-c", chatty], quiet_s=1.0, out=out) == 0
    assert out.getvalue().decode().split() == [str(i) for i in range(6)]


def test_pip_sees_a_terminal_when_we_are_one(install, monkeypatch):
    """On a terminal the command runs on a pseudo-terminal: pip keeps its progress bars."""
    if sys.platform == "win32":
        pytest.skip("no pseudo-terminals on Windows (a pipe is used)")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Tty())
    out = io.BytesIO()
    assert (
        install.run_watched([sys.executable, "-c", "import sys; print(sys.stdout.isatty())"], 1.0, out) == 0
    )
    assert out.getvalue().decode().strip() == "True"


def test_dry_run_announces_each_step_and_keeps_an_installed_torch():
    proc = subprocess.run(
        [sys.executable, "scripts/install.py", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("make install: torch is installed")  # the test interpreter has torch
    assert lines[1].startswith("make install: step 1/1: installing this package (editable)")
    assert lines[2].endswith("-m pip install --progress-bar on -e .[bench,dev,cluster]")


def test_the_makefile_installs_through_the_script():
    proc = subprocess.run(["make", "-n", "install"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.skip(f"make is not available: {proc.stderr.strip()}")
    assert "scripts/install.py --torch 2.13.0 --extras bench,dev,cluster" in proc.stdout


def test_the_line_names_what_pip_is_doing(install):
    unpacking = [
        "Installing collected packages: torch",
        "  Attempting uninstall: torch",
        "  Successfully uninstalled torch",
    ]
    assert install._phase(unpacking).startswith("unpacking and byte-compiling")
    assert install._phase(["Obtaining file:///x", "  Installing build dependencies ... "]) == "building"
    assert (
        install._phase(["Collecting torch", "  Downloading torch.whl (200 MB)"])
        == "resolving and downloading"
    )
    assert install._phase([]) == "working"
