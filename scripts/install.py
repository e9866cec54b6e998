"""`make install`: torch unless it is there, then this package (editable) with extras; never silent
for long. Standard library only (it runs before anything is installed).

    python scripts/install.py [--torch 2.13.0] [--extras bench,dev,cluster] [--quiet-s 10] [--dry-run]

The `bench` extra is the harness (Hydra, pandas, scipy, plots, the task generators); without it only
the library `snapkv/` is usable, so the default installs it.

Why: pip shows download bars and spinners, but nothing while it unpacks and byte-compiles the
wheels ("Installing collected packages: ..."; pip < 25.1 has no progress bar there, later ones
only on a terminal), and for torch or the package's ~100 dependencies that step takes tens of
seconds on a slow machine. So each step is announced with what it does and roughly how long it
takes, pip's output is relayed as it comes (under a pseudo-terminal when ours is one, so pip keeps
its bars), and when pip has printed nothing for `--quiet-s` seconds one line says that it is still
working, at what, and for how long.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import queue
import subprocess
import sys
import threading
import time

PREFIX = "make install:"


def say(msg: str) -> None:
    print(f"{PREFIX} {msg}", flush=True)


def _phase(lines: list[str]) -> str:
    """What pip is doing, judged from the last lines it printed (latest first wins)."""
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("Installing collected packages") or "uninstall" in line.lower():
            return "unpacking and byte-compiling the wheels; pip prints nothing until it is done"
        if line.startswith(
            ("Building", "Installing build dependencies", "Preparing", "Getting requirements")
        ):
            return "building"
        if line.startswith(("Collecting", "Downloading", "Processing", "Obtaining", "Looking")):
            return "resolving and downloading"
    return "working"


def _open_output(cmd: list[str]) -> tuple[subprocess.Popen, int]:
    """Start `cmd` with its stdout+stderr on a pseudo-terminal when ours is a terminal (pip then
    draws its progress bars, at our terminal's width), else on a pipe. Returns (process, read fd)."""
    if sys.stdout.isatty() and os.name == "posix":
        import fcntl  # POSIX-only modules, so imported only on this branch
        import pty
        import termios

        master, slave = pty.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.ONLCR  # relay "\n" as it is: our own terminal adds the "\r"
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        try:
            fcntl.ioctl(
                slave, termios.TIOCSWINSZ, fcntl.ioctl(sys.stdout.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
            )
        except OSError:
            pass  # the pty's default size then
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
        os.close(slave)
        return proc, master
    read, write = os.pipe()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=write, stderr=write)
    os.close(write)
    return proc, read


def run_watched(cmd: list[str], quiet_s: float = 10.0, out=None) -> int:
    """Run `cmd`, relaying its output to `out` (default: our stdout) as it comes; after `quiet_s`
    seconds without output (and every `quiet_s` after that) write one line saying it is still
    running. Returns its exit code."""
    out = out if out is not None else sys.stdout.buffer
    proc, fd = _open_output(cmd)
    chunks: queue.Queue[bytes] = queue.Queue()

    def reader() -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the pty's other side closed (the process ended)
                data = b""
            chunks.put(data)
            if not data:
                return

    threading.Thread(target=reader, daemon=True).start()
    start = last_output = last_beat = time.monotonic()
    tail = b"\n"  # the last bytes relayed: where the cursor is, and pip's last line
    try:
        while True:
            try:
                data = chunks.get(timeout=min(1.0, quiet_s))
            except queue.Empty:
                now = time.monotonic()
                if now - max(last_output, last_beat) >= quiet_s:
                    lines = tail.replace(b"\r", b"\n").decode(errors="replace").splitlines()
                    line = (
                        f"{PREFIX} ... pip is still {_phase(lines)} "
                        f"({now - last_output:.0f} s since its last output, {now - start:.0f} s in all)\n"
                    )
                    out.write((b"" if tail.endswith(b"\n") else b"\n") + line.encode())
                    out.flush()
                    last_beat = now
                continue
            if not data:
                break
            out.write(data)
            out.flush()
            tail = (tail + data)[-4096:]
            last_output = time.monotonic()
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        return 130
    finally:
        os.close(fd)


def plan(torch_version: str, extras: str) -> list[tuple[str, list[str]]]:
    """The steps: (announcement, pip command)."""
    pip = [sys.executable, "-m", "pip", "install", "--progress-bar", "on"]
    steps = []
    if importlib.util.find_spec("torch") is None:
        steps.append(
            (
                f"installing torch=={torch_version} first (a CPU build where the index has one, ~200 MB; "
                "pip then unpacks it without output for ~20-60 s)...",
                [*pip, f"torch=={torch_version}"],
            )
        )
    else:
        say(f"torch is installed ({sys.executable}): kept")
    target = f".[{extras}]" if extras else "."
    steps.append(
        (
            f"installing this package (editable) and its ~100 dependencies{f' with {extras}' if extras else ''}: "
            "pip resolves and downloads them (progress bars), then unpacks them without output "
            "(~30-90 s in a fresh environment, seconds when they are there already)...",
            [*pip, "-e", target],
        )
    )
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/install.py", description=__doc__.split("\n")[0])
    ap.add_argument("--torch", default="2.13.0", help="torch version installed when torch is missing")
    ap.add_argument(
        "--extras", default="bench,dev,cluster", help="the package's optional extras (comma-separated)"
    )
    ap.add_argument("--quiet-s", type=float, default=10.0, help="say pip is still working after this silence")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and commands, run nothing")
    args = ap.parse_args(argv)
    if args.quiet_s <= 0:
        raise SystemExit(f"error: --quiet-s must be positive, got --quiet-s={args.quiet_s}")
    start = time.monotonic()
    steps = plan(args.torch, args.extras)
    for i, (what, cmd) in enumerate(steps, 1):
        say(f"step {i}/{len(steps)}: {what}")
        say("$ " + " ".join(cmd))
        if args.dry_run:
            continue
        rc = run_watched(cmd, args.quiet_s)
        if rc != 0:
            say(f"step {i} failed (pip exit code {rc})")
            return rc
    if not args.dry_run:
        say(f"done in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
