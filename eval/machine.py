"""What the machine was doing while a timing ran: CPU that other processes used, load average and the
thread settings. Every result row and benchmark row records these.

A timing on a shared node is only as good as the CPU it had to itself. `CpuNoise` reads the
machine-wide busy time (`/proc/stat` through psutil: every CPU's user + nice + system + irq +
softirq + steal) and this process's own CPU time (all its threads) at the start and the end of a
block; the difference is what *other* processes (and the hypervisor, `steal`) used meanwhile:

    other_cpu_s = Δ machine busy - Δ own CPU       other_cores = other_cpu_s / Δ wall

`other_cores` is the mean number of cores others kept busy (0 on a quiet machine, up to the core
count). A measurement above a threshold is flagged, not silently averaged in.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import psutil
import torch

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")
# /proc/cpuinfo flags that pick torch's CPU matmul kernels beyond its dispatch level: bfloat16 and
# float16 run on AMX tiles where present, else on AVX-512 BF16/FP16 or by upcasting, at several-fold
# different speeds and with different accumulation orders.
MATMUL_FLAGS = ("avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def _own_cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()  # all threads of this process
    return t.user + t.system


@dataclass
class CpuNoise:
    """Context manager: CPU used by other processes while the block ran (see module doc).

    After the block: `wall_s`, `own_cpu_s` (this process, all threads), `other_cpu_s`,
    `other_cores` (= other_cpu_s / wall_s), `load_start` / `load_end` (1-minute load average).
    """

    wall_s: float = 0.0
    own_cpu_s: float = 0.0
    other_cpu_s: float = 0.0
    other_cores: float = 0.0
    load_start: float = 0.0
    load_end: float = 0.0
    _start: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), repr=False)

    def __enter__(self) -> CpuNoise:
        self._proc = psutil.Process()
        self.load_start = os.getloadavg()[0]
        self._start = (time.perf_counter(), busy_s(), _own_cpu_s(self._proc))
        return self

    def __exit__(self, *exc) -> None:
        t1, busy1, own1 = time.perf_counter(), busy_s(), _own_cpu_s(self._proc)
        t0, busy0, own0 = self._start
        self.wall_s = t1 - t0
        self.own_cpu_s = own1 - own0
        # Clamped at 0: /proc/stat and the per-process counters tick at different moments.
        self.other_cpu_s = max(0.0, (busy1 - busy0) - self.own_cpu_s)
        self.other_cores = self.other_cpu_s / self.wall_s if self.wall_s > 0 else 0.0
        self.load_end = os.getloadavg()[0]

    def fields(self) -> dict[str, float]:
        return {
            "wall_s": self.wall_s,
            "own_cpu_s": self.own_cpu_s,
            "other_cpu_s": self.other_cpu_s,
            "other_cores": self.other_cores,
            "load_start": self.load_start,
            "load_end": self.load_end,
        }


CPUINFO = "/proc/cpuinfo"


@functools.cache
def cpu_kernels() -> str:
    """torch's CPU dispatch level and the MATMUL_FLAGS this CPU has, e.g. "AVX512 avx512_bf16
    amx_tile amx_bf16": rows run in bfloat16 on machines that differ here differ in speed, and may
    differ in their last bits."""
    try:
        with open(CPUINFO, encoding="utf-8") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "flags:")
    except OSError:  # not Linux: the dispatch level alone
        line = "flags:"
    flags = set(line.split(":", 1)[1].split())
    return " ".join([torch.backends.cpu.get_cpu_capability(), *(x for x in MATMUL_FLAGS if x in flags)])


def thread_settings() -> dict[str, str | int]:
    """Thread settings that change CPU timings: torch's intra-op threads and the OpenMP/MKL
    environment (empty string: unset)."""
    out: dict[str, str | int] = {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count() or 0}
    out.update({k.lower(): os.environ.get(k, "") for k in THREAD_ENV})
    return out
