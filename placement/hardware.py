"""Hardware profiles: the machine numbers the cost model plans with, saved as JSON.

Example::

    hw = load_hardware("rtx4090")            # a preset, or a JSON file written by `tandem probe`
    hw.gpu_bandwidth_bytes_per_s             # 1.008e12
    save_hardware(hw, "my-machine.json"); load_hardware("my-machine.json") == hw  # True
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.core.artifacts import atomic_write_json, fingerprint
from tandem.core.errors import TandemError

GiB = 2**30
MiB = 2**20
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class HardwareProfile:
    """One CPU + (optionally) one GPU. ``gpu_memory_bytes == 0`` means no GPU (all-CPU plans)."""
    name: str
    gpu_memory_bytes: int
    gpu_bandwidth_bytes_per_s: float
    gpu_matmul_flops: float
    cpu_bandwidth_bytes_per_s: float
    cpu_matmul_flops: float
    h2d_bandwidth_bytes_per_s: float
    layer_sync_latency_s: float
    cpu_threads: int
    description: str = ""  # provenance (preset sources, probe date); not part of the fingerprint
    # seconds per kernel of the GPU step replayed in a CUDA graph (online/gpu: latency-bound at decode
    # sizes); measured by `tandem probe` on CUDA; 0 = not modeled (and not part of the fingerprint then)
    gpu_launch_s: float = 0.0
    # seconds per host call of the GPU step's CPU share (one fused C call: an OpenMP region entered while its
    # threads waited on the GPU); 0 = not modeled (and not part of the fingerprint then)
    cpu_call_s: float = 0.0

    def __post_init__(self) -> None:
        def bad(msg: str) -> TandemError:
            return TandemError(f"invalid hardware profile {self.name!r}: {msg}")
        if not isinstance(self.name, str) or not _NAME_PATTERN.match(self.name):
            raise bad("name must be 1-64 characters of letters, digits, '.', '_' or '-'")
        for key in ("gpu_memory_bytes", "cpu_threads"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(f"{key} must be an integer, got {value!r}")
        for key in ("gpu_bandwidth_bytes_per_s", "gpu_matmul_flops", "cpu_bandwidth_bytes_per_s",
                    "cpu_matmul_flops", "h2d_bandwidth_bytes_per_s", "layer_sync_latency_s", "gpu_launch_s",
                    "cpu_call_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise bad(f"{key} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, key, float(value))
        if self.gpu_memory_bytes < 0:
            raise bad("gpu_memory_bytes must be >= 0")
        if self.cpu_threads < 1:
            raise bad("cpu_threads must be >= 1")
        for key in ("cpu_bandwidth_bytes_per_s", "cpu_matmul_flops"):
            if getattr(self, key) <= 0:
                raise bad(f"{key} must be positive")
        if self.has_gpu:
            for key in ("gpu_bandwidth_bytes_per_s", "gpu_matmul_flops", "h2d_bandwidth_bytes_per_s"):
                if getattr(self, key) <= 0:
                    raise bad(f"{key} must be positive when the profile has a GPU (gpu_memory_bytes > 0)")

    @property
    def has_gpu(self) -> bool:
        return self.gpu_memory_bytes > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "hardware profile") -> "HardwareProfile":
        if not isinstance(data, dict):
            raise TandemError(f"{source}: expected a JSON object with the hardware fields")
        known = {f.name for f in dataclasses.fields(cls)}
        required = known - {"description", "gpu_launch_s", "cpu_call_s"}
        missing = sorted(required - data.keys())
        unknown = sorted(data.keys() - known)
        if missing:
            raise TandemError(f"{source}: missing fields {', '.join(missing)}")
        if unknown:
            raise TandemError(f"{source}: unknown fields {', '.join(unknown)}")
        return cls(**data)

    @property
    def fingerprint(self) -> str:
        """Hash of the numbers that change a plan (name and description excluded)."""
        values = {k: v for k, v in self.to_dict().items() if k not in ("name", "description")}
        for key in ("gpu_launch_s", "cpu_call_s"):
            if not values[key]:
                del values[key]  # profiles from before the term keep their fingerprints
        return fingerprint(values)


def save_hardware(hardware: HardwareProfile, path: str | Path) -> Path:
    """Write the profile as JSON (atomically)."""
    atomic_write_json(path, hardware.to_dict())
    return Path(path)


# --- presets (peak datasheet figures unless noted; decode is memory-bound, so bandwidths matter most) ---
PRESETS: dict[str, HardwareProfile] = {
    "rtx4090": HardwareProfile(
        name="rtx4090",
        gpu_memory_bytes=24 * GiB,  # NVIDIA RTX 4090 datasheet: 24 GB GDDR6X
        gpu_bandwidth_bytes_per_s=1008e9,  # datasheet: 21 Gbps x 384-bit = 1008 GB/s
        gpu_matmul_flops=165.2e12,  # Ada whitepaper: FP16 tensor, FP32 accumulate, dense
        # PowerInfer paper (arXiv 2312.12456) testbed PC-High: i9-13900K, 192 GB DDR5,
        # "memory bandwidth of 67.2 GB/s", PCIe 4.0
        cpu_bandwidth_bytes_per_s=67.2e9,
        cpu_matmul_flops=1.2e12,  # estimate: 8 P-cores x 2 AVX2 FMA x 8 fp32 x 2 flop x ~4.8 GHz
        h2d_bandwidth_bytes_per_s=25e9,  # PCIe 4.0 x16: 31.5 GB/s per direction peak; ~25 GB/s pinned copies (typical)
        layer_sync_latency_s=20e-6,  # estimate: two small cudaMemcpy (~8 us each) + CPU thread barrier
        cpu_threads=8,  # PowerInfer's evaluation used the 8 performance cores
        description="RTX 4090 + i9-13900K, PCIe 4.0 (PowerInfer's PC-High testbed)"),
    "rtx2080ti": HardwareProfile(
        name="rtx2080ti",
        gpu_memory_bytes=11 * GiB,  # NVIDIA RTX 2080 Ti datasheet: 11 GB GDDR6
        gpu_bandwidth_bytes_per_s=616e9,  # datasheet: 14 Gbps x 352-bit = 616 GB/s
        gpu_matmul_flops=53.8e12,  # Turing whitepaper: FP16 tensor with FP32 accumulate (GeForce half rate)
        # PowerInfer paper testbed PC-Low: i7-12700K, 64 GB host memory, 38.4 GB/s, PCIe 3.0
        cpu_bandwidth_bytes_per_s=38.4e9,
        cpu_matmul_flops=1.0e12,  # estimate: 8 P-cores x 2 AVX2 FMA x 8 fp32 x 2 flop x ~4 GHz
        h2d_bandwidth_bytes_per_s=12e9,  # PCIe 3.0 x16: 15.75 GB/s peak; ~12 GB/s pinned copies (typical)
        layer_sync_latency_s=25e-6,  # estimate: as rtx4090, slower bus
        cpu_threads=8,
        description="RTX 2080 Ti + i7-12700K, PCIe 3.0 (PowerInfer's PC-Low testbed)"),
    "t4": HardwareProfile(
        name="t4",
        gpu_memory_bytes=15 * GiB,  # NVIDIA T4 datasheet: 16 GB GDDR6 (about 15 GiB usable)
        gpu_bandwidth_bytes_per_s=320e9,  # T4 datasheet: 320 GB/s
        gpu_matmul_flops=65e12,  # T4 datasheet: 65 TFLOPS mixed precision (FP16/FP32)
        # host: a cloud VM with 2 vCPUs (mixtral-offloading's free Colab T4 setting): estimates
        cpu_bandwidth_bytes_per_s=10e9,  # estimate for 2 vCPUs on a shared Xeon host
        cpu_matmul_flops=100e9,  # estimate: 1 core x AVX-512 FMA at ~2.2 GHz, sustained
        h2d_bandwidth_bytes_per_s=12e9,  # PCIe 3.0 x16 (T4 datasheet), ~12 GB/s pinned copies (typical)
        layer_sync_latency_s=30e-6,  # estimate: virtualised host, slower launches
        cpu_threads=2,
        description="NVIDIA T4 on a 2-vCPU cloud VM, PCIe 3.0 (mixtral-offloading's Colab setting)"),
    "h100": HardwareProfile(
        name="h100",
        gpu_memory_bytes=80 * GiB,  # NVIDIA H100 80GB HBM3 (the GPU machine lent to this project)
        gpu_bandwidth_bytes_per_s=2.9e12,  # measured there by `tandem probe` (2026-11-23, ../shared/gpu/README.md)
        gpu_matmul_flops=789e12,  # measured there: 8192^3 bf16 matmul 769-798 TFLOP/s (device KINDS.md)
        cpu_bandwidth_bytes_per_s=84e9,  # measured there by `tandem probe` (8 threads)
        cpu_matmul_flops=0.6e12,  # estimate: 8 cores x 2 AVX2 FMA x 8 fp32 x 2 flop x ~2.4 GHz
        h2d_bandwidth_bytes_per_s=54e9,  # measured there by `tandem probe`
        layer_sync_latency_s=54e-6,  # measured there by `tandem probe`: a 4 KB round trip
        cpu_threads=8,
        description="NVIDIA H100 80GB + 16-core host (8 threads used), as measured on the lent GPU machine",
        gpu_launch_s=4.6e-6,  # measured 2026-11-27: 846 us of graph replay for the GPU step's 183 kernels (SmolLM2)
        # measured 2026-11-27 (bench.gpu_ab): a second C call per token (the 10% plan's output layer after its GPU
        # layers, against layer offload's one call) cost 15 us with spinning OpenMP threads, ~250 us with libgomp's
        # default wait; the lower figure
        cpu_call_s=15e-6),
    "cpu-only": HardwareProfile(
        name="cpu-only",
        gpu_memory_bytes=0, gpu_bandwidth_bytes_per_s=0.0, gpu_matmul_flops=0.0,  # no GPU
        cpu_bandwidth_bytes_per_s=32e9,  # measured here: torch sum over 1 GiB, 2 threads (../shared/measurements.md)
        cpu_matmul_flops=120e9,  # measured here: float32 matmul, 2 threads, 119-134 GFLOP/s
        h2d_bandwidth_bytes_per_s=0.0,  # no device to copy to
        layer_sync_latency_s=0.0,  # nothing to synchronise with
        cpu_threads=2,
        description="No GPU: all-CPU sparse execution (numbers measured on the 2-core development machine)"),
}


def load_hardware(preset_or_path: str | Path) -> HardwareProfile:
    """A preset by name (``rtx4090``, ``rtx2080ti``, ``t4``, ``cpu-only``) or a JSON file."""
    key = str(preset_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if not path.is_file():
        raise TandemError(f"unknown hardware {key!r}: not a preset ({', '.join(PRESETS)}) nor a JSON file "
                          f"(write one with `tandem probe --out FILE`)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise TandemError(f"cannot read hardware profile {path}: {str(e).splitlines()[0]}") from None
    return HardwareProfile.from_dict(data, source=f"hardware profile {path}")
