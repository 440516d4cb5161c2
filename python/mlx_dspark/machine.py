"""What machine this is, in words: the processor's and the device's names (benchmark records, cache
keys); and how busy other processes keep it (a measurement that shared it is not to be kept)."""

from __future__ import annotations

import os
import platform
import time


def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo on Linux), else the machine type."""
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name() -> str:
    """The default device in words: "cpu: <processor>; <n> cores" or "gpu: <name>"."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return f"cpu: {cpu_name()}; {os.cpu_count()} cores"
    try:
        return f"gpu: {mx.device_info().get('device_name', 'gpu')}"
    except Exception:
        return "gpu"


def _busy_cpu_seconds() -> float | None:
    """Seconds of CPU time all processes have used since boot, every CPU together (Linux's
    /proc/stat: all but idle and iowait; steal counts, as time the machine's host gave away), or
    None where that cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _own_cpu_seconds() -> float:
    """This process's CPU time, with that of the children it waited for (MLX's CPU backend compiles
    kernels in g++ processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OthersShare:
    """The share of the machine's CPU capacity that other processes used from construction to
    `share()`: on Linux from /proc/stat, elsewhere from the 1-minute load average (runnable threads,
    less this process's own share; it lags, so it errs towards busy after a busy spell)."""

    def __init__(self):
        self.cpus = os.cpu_count() or 1
        self.t0, self.own0, self.all0 = time.perf_counter(), _own_cpu_seconds(), _busy_cpu_seconds()

    def share(self) -> float | None:
        wall = max(time.perf_counter() - self.t0, 1e-6)
        own = _own_cpu_seconds() - self.own0
        busy = _busy_cpu_seconds()
        if busy is not None and self.all0 is not None:
            others = busy - self.all0 - own
        else:
            try:
                others = (os.getloadavg()[0] - own / wall) * wall
            except (OSError, AttributeError):
                return None
        return min(max(others / (wall * self.cpus), 0.0), 1.0)
