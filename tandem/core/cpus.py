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
