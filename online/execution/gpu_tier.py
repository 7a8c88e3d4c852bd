"""The GPU tier: a device plus a byte budget that every placed tensor is charged against.

On a machine with CUDA the tier lives on the GPU; otherwise (or with ``device="cpu"``) it runs on
the CPU with the same code path and the same budget accounting, so hybrid logic is testable anywhere.

Example::

    tier = GpuTier.create(budget_bytes=2 << 30)          # "cuda" when available, else "cpu"
    if tier.can_allocate(w.numel() * w.element_size()):
        w_gpu = tier.allocate("layers.3.hot_up", w)      # copied to the tier's device, bytes charged
    tier.used_bytes, tier.peak_bytes
    tier.bytes_by_kind()                                 # {"ffn_neurons": ..., ...} as plan.json names them
"""
from __future__ import annotations

import torch

from tandem.core.errors import TandemError

# name pattern -> the plan's ``gpu_bytes_by_kind`` key (first match wins)
_KIND_BY_PART = (("experts.", "experts"), (".shared_expert", "shared_experts"), (".hot_", "ffn_neurons"),
                 (".predictor", "predictors"), (".attention", "attention_and_kv"), (".kv_", "attention_and_kv"),
                 ("output_head", "output_head"), ("embeddings", "embeddings"))


def kind_of(name: str) -> str:
    """The plan's byte kind for a tier tensor name (``layers.3.hot_up`` -> ``ffn_neurons``)."""
    for part, kind in _KIND_BY_PART:
        if name.startswith(part) or part in name:
            return kind
    return "other"


class GpuTier:
    def __init__(self, device: torch.device, budget_bytes: int, threads: int | None = None) -> None:
        if budget_bytes < 0:
            raise TandemError(f"GPU budget must be >= 0 bytes, got {budget_bytes}")
        if threads is not None and threads < 1:
            raise TandemError(f"GPU-tier threads must be >= 1, got {threads}")
        if device.type == "cuda" and device.index is None:  # the index its tensors report (cuda:0), so == holds
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.threads = threads or torch.get_num_threads()  # CPU-kernel threads when the tier is the CPU
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self.bytes_copied = 0  # host -> tier traffic, for bytes_moved_per_token
        self._owned: dict[str, int] = {}
        self._kinds: dict[str, str] = {}
        # host <-> tier exchanges: counted on every device (on a CPU tier they are the same structure, no copy)
        self.exchanges = 0  # results handed back to the host (a sync on CUDA)
        self.link_bytes = 0  # activation bytes sent to and fetched from the tier
        self.tier_calls = 0  # units computed on the tier (each a short burst of kernel launches)
        self.launches = 0  # kernels launched by the GPU step (online.gpu), in graphs or not
        self.graph_replays = 0  # CUDA graphs replayed by the GPU step
        self._pinned: dict[tuple, torch.Tensor] = {}

    @classmethod
    def create(cls, budget_bytes: int, device: str | None = None, threads: int | None = None) -> "GpuTier":
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise TandemError("--gpu-device cuda requested but no CUDA device is available")
        if device not in ("cpu",) and not device.startswith("cuda"):
            raise TandemError(f"unknown GPU-tier device {device!r} (use 'cuda' or 'cpu')")
        return cls(torch.device(device), budget_bytes, threads)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def can_allocate(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.budget_bytes

    def allocate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Place ``tensor`` on the tier under ``name``; refuse if it would exceed the budget."""
        nbytes = tensor.numel() * tensor.element_size()
        if name in self._owned:
            raise TandemError(f"GPU tier already holds {name}")
        if not self.can_allocate(nbytes):
            raise TandemError(f"GPU budget exceeded placing {name}: {nbytes} bytes needed, "
                              f"{self.free_bytes} of {self.budget_bytes} free")
        self._owned[name] = nbytes
        self._kinds[name] = kind_of(name)
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        if tensor.device != self.device:
            self.bytes_copied += nbytes
            return tensor.to(self.device, non_blocking=self.is_cuda)
        return tensor.clone()

    # --- the link: one send and one fetch per unit that uses the tier --------------------------
    def _staging(self, key: str, like: torch.Tensor) -> torch.Tensor:
        slot = (key, tuple(like.shape), like.dtype)
        buf = self._pinned.get(slot)
        if buf is None:
            buf = self._pinned[slot] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return buf

    def send(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (host) on the tier; on CUDA through a pinned buffer, asynchronously."""
        self.tier_calls += 1
        self.link_bytes += x.numel() * x.element_size()
        if not self.is_cuda:
            return x
        staged = self._staging("in", x)
        staged.copy_(x)
        return staged.to(self.device, non_blocking=True)

    def fetch_async(self, y: torch.Tensor):
        """Start copying ``y`` (on the tier) back to the host; ``wait`` the handle to get it."""
        self.link_bytes += y.numel() * y.element_size()
        if not self.is_cuda:
            return y, None
        staged = self._staging("out", y)
        staged.copy_(y, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return staged, event

    def wait(self, handle) -> torch.Tensor:
        """The host tensor of a ``fetch_async`` (the one sync of that unit)."""
        y, event = handle
        self.exchanges += 1
        if event is not None:
            event.synchronize()
            return y.clone()
        return y

    def fetch(self, y: torch.Tensor) -> torch.Tensor:
        return self.wait(self.fetch_async(y))

    def link_counters(self) -> dict[str, int]:
        return {"tier_calls": self.tier_calls, "tier_syncs": self.exchanges, "link_bytes": self.link_bytes,
                "launches": self.launches, "graph_replays": self.graph_replays}

    def release(self, name: str) -> None:
        self.used_bytes -= self._owned.pop(name)
        del self._kinds[name]

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes held now, by the plan's kinds (``ffn_neurons``, ``experts``, ``attention_and_kv``, ...)."""
        out: dict[str, int] = {}
        for name, nbytes in self._owned.items():
            out[self._kinds[name]] = out.get(self._kinds[name], 0) + nbytes
        return out
