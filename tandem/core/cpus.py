"""The CPUs this process may run on (its affinity mask, which a container or ``taskset`` narrows; the machine's
count where the platform has no affinity call).

Example::

    threads = min(requested, usable_cpus())
"""
from __future__ import annotations

import os


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def max_threads() -> int:
    """The most threads an engine (or a probe, whose count plans run with) takes: 8 per usable CPU (more only wait
    on each other; 100,000 failed to start)."""
    return 8 * usable_cpus()
