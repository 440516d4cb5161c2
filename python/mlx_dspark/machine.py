"""What machine this is, in words: the processor's name (for benchmark records and cost keys)."""

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
