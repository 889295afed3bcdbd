"""What host a certification ran on: CPU model, cores, memory, OS (Linux /proc, with portable fallbacks)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from dgr.core.certificate import Hardware


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _os_name() -> str:
    pretty = ""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                pretty = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    plat = platform.platform()
    return f"{pretty} ({plat})" if pretty else plat


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask where there is one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host(gpu: str = "") -> Hardware:
    return Hardware(cpu_model=_cpu_model(), cores=usable_cores(), memory_bytes=_memory_bytes(), os=_os_name(),
                    machine=platform.machine(), gpu=gpu)
