"""Measure this machine: CPU read bandwidth and matmul rate (and the GPU's when CUDA is present).

A few repetitions each, the median kept; the whole probe stays within about 10 seconds.

Example::

    hw = probe_machine(threads=2)
    save_hardware(hw, "this-machine.json")
"""
from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from tandem.core.errors import TandemError

from .hardware import HardwareProfile

CPU_BUFFER_BYTES = 256 * 2**20  # far beyond any last-level cache
GPU_BUFFER_BYTES = 1024 * 2**20
MATMUL_SIZE = 1024
REPEATS = 5
SECONDS_PER_MEASUREMENT = 1.5  # each measurement stops repeating after this long


def _median_seconds(run: Callable[[], None], sync: Callable[[], None] = lambda: None) -> float:
    run()  # warm-up
    sync()
    times, deadline = [], time.perf_counter() + SECONDS_PER_MEASUREMENT
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return statistics.median(times)


CACHE_INFO = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(default: int = 32 * 2**20, root: Path = CACHE_INFO) -> int:
    """The largest CPU cache the kernel reports (sysfs: the last level's ``size``; a VM's nominal figure, of
    which it may get only part), or ``default`` where none is reported.

    Example::

        last_level_cache_bytes()     # 314572800 on the Intel VM (L3 "307200K")
    """
    best = 0
    for index in Path(root).glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best or default


def measure_read_bandwidth(device: str = "cpu", num_bytes: int = CPU_BUFFER_BYTES) -> float:
    """Bytes per second read by ``torch.sum`` over a float32 buffer of ``num_bytes``."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)  # [N]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    seconds = _median_seconds(lambda: buffer.sum(), sync)
    return buffer.numel() * 4 / seconds


def measure_matmul_flops(device: str = "cpu", size: int = MATMUL_SIZE, dtype: torch.dtype = torch.float32) -> float:
    """Floating-point operations per second of a square matmul."""
    a = torch.randn(size, size, dtype=dtype, device=device)  # [n, n]
    b = torch.randn(size, size, dtype=dtype, device=device)  # [n, n]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    seconds = _median_seconds(lambda: a @ b, sync)
    return 2.0 * size**3 / seconds


def _measure_gpu() -> dict[str, float | int]:
    props = torch.cuda.get_device_properties(0)
    host = torch.ones(256 * 2**20 // 4, dtype=torch.float32).pin_memory()  # [N] pinned
    device_buffer = torch.empty_like(host, device="cuda")
    copy_s = _median_seconds(lambda: device_buffer.copy_(host, non_blocking=True), torch.cuda.synchronize)
    tiny = torch.ones(1024, dtype=torch.float32)  # a hidden-state-sized round trip
    sync_s = _median_seconds(lambda: tiny.to("cuda").to("cpu"), torch.cuda.synchronize)
    return {"gpu_memory_bytes": int(props.total_memory),
            "gpu_bandwidth_bytes_per_s": measure_read_bandwidth("cuda", GPU_BUFFER_BYTES),
            "gpu_matmul_flops": measure_matmul_flops("cuda", 4096, torch.float16),
            "h2d_bandwidth_bytes_per_s": host.numel() * 4 / copy_s,
            "layer_sync_latency_s": sync_s}


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's CPU ops on ``threads`` threads inside the block, the previous count restored after it.

    Example::

        with torch_threads(2):
            bandwidth = measure_read_bandwidth("cpu")
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def probe_machine(threads: int | None = None, name: str = "probed") -> HardwareProfile:
    """A HardwareProfile with this machine's measured numbers (no GPU fields when CUDA is absent)."""
    threads = threads if threads is not None else (os.cpu_count() or 1)
    if threads < 1:
        raise TandemError(f"threads must be >= 1, got {threads}")
    with torch_threads(threads):
        cpu_bandwidth = measure_read_bandwidth("cpu")
        cpu_flops = measure_matmul_flops("cpu")
    gpu = {"gpu_memory_bytes": 0, "gpu_bandwidth_bytes_per_s": 0.0, "gpu_matmul_flops": 0.0,
           "h2d_bandwidth_bytes_per_s": 0.0, "layer_sync_latency_s": 0.0}
    device_name = "no GPU"
    if torch.cuda.is_available():
        gpu = _measure_gpu()
        device_name = torch.cuda.get_device_name(0)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    return HardwareProfile(name=name, cpu_bandwidth_bytes_per_s=cpu_bandwidth, cpu_matmul_flops=cpu_flops,
                           cpu_threads=threads, description=f"measured by `tandem probe` on {stamp} ({threads} threads, {device_name})",
                           **gpu)
