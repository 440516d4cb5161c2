"""What machine this is, in words: the processor's and the device's names (benchmark records, cache keys)."""

from __future__ import annotations

import platform


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
    import os

    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return f"cpu: {cpu_name()}; {os.cpu_count()} cores"
    try:
        return f"gpu: {mx.device_info().get('device_name', 'gpu')}"
    except Exception:
        return "gpu"
