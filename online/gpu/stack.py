"""The pieces a GPU-step program is made of: ``Launch`` (device work, capturable) and ``Host`` actions,
the ``StepContext`` they share (device buffers, pinned host buffers, the link counters), ``check_model``
(the model families the step covers) and ``fuse_rows`` (q/k/v as one matrix). ``program`` and
``layer_actions`` build a token from them; ``graph_step`` runs it.

Example::

    ctx = StepContext.create(torch.device("cuda"), d=576, ops=Ops.create(torch.device("cuda")))
    ctx.fetch_async(ctx.x, ctx.x_host); ...; ctx.wait()      # one exchange: a sync, d floats counted
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tandem.core.errors import TandemError

from .ops import SUPPORTED_ACTS, Mat, Ops


class GpuStepUnavailable(TandemError):
    """This model / placement has no GPU step (the message says why)."""


@dataclass
class Launch:
    """Device work (kernel launches only: capturable)."""
    run: Callable[[], None]
    name: str = ""


@dataclass
class Host:
    """Host work between groups (copies, waits, CPU compute). ``barrier=False``: bookkeeping that touches
    no device buffer, run after the token's groups instead of splitting one."""
    run: Callable[[], None]
    name: str = ""
    barrier: bool = True


@dataclass
class StepContext:
    """Buffers of one step (device and pinned host), the ops, and per-step state shared by the actions."""
    device: torch.device
    ops: Ops
    d: int
    inputs: torch.Tensor  # [2] int64 on the device: token id, position
    inputs_host: torch.Tensor  # [2] int64 (pinned on CUDA)
    x: torch.Tensor  # [d] the residual stream
    hn: torch.Tensor  # [d] a cold part's normed input
    y_cold: torch.Tensor  # [d] a cold part's output, sent to the tier
    x_host: torch.Tensor  # [d]
    hn_host: torch.Tensor
    y_cold_host: torch.Tensor
    scratch: dict = field(default_factory=dict)  # shared by name: qkv, q, attn, o_out, h, ffn_out, logits
    state: dict = field(default_factory=dict)  # token_id, pos, cache, logits (host) of the step in flight
    syncs: int = 0
    link_bytes: int = 0

    @classmethod
    def create(cls, device: torch.device, d: int, ops: Ops) -> "StepContext":
        pin = device.type == "cuda"

        def host(*shape, dtype=torch.float32):
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)
        dev = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(device, ops, d, dev(2, dtype=torch.long), host(2, dtype=torch.long), dev(d), dev(d), dev(d),
                   host(d), host(d), host(d))

    def buffer(self, name: str, size: int, dtype=torch.float32) -> torch.Tensor:
        """A device scratch buffer of at least ``size`` elements (the first ``size`` returned)."""
        buf = self.scratch.get(name)
        if buf is None or buf.numel() < size:
            buf = self.scratch[name] = torch.zeros(size, dtype=dtype, device=self.device)
        return buf[:size]

    @property
    def token(self) -> torch.Tensor:
        return self.inputs[0:1]

    @property
    def pos(self) -> torch.Tensor:
        return self.inputs[1:2]

    def fetch_async(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Start dst (host, pinned) <- src (device); ``wait`` is the sync. Later launches may run meanwhile."""
        dst.copy_(src, non_blocking=True)
        self.link_bytes += src.numel() * src.element_size()
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.state["fetch_event"] = event

    def wait(self) -> None:
        """The sync of the last ``fetch_async``."""
        event = self.state.pop("fetch_event", None)
        if event is not None:
            event.synchronize()
        self.syncs += 1

    def fetch(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """dst (host) <- src (device), waited for: one sync."""
        self.fetch_async(src, dst)
        self.wait()
        return dst

    def residual_on_host(self) -> torch.Tensor:
        """``x_host``: the residual stream, fetched unless the host holds it already (it wrote it last and
        no launch ran since: ``state["host_fresh"]``)."""
        if not self.state.get("host_fresh"):
            self.fetch(self.x, self.x_host)
        return self.x_host

    def send_residual(self) -> None:
        """``x_host`` -> ``x``; the host's copy stays current until the next launch group."""
        self.send(self.x_host, self.x)
        self.state["host_fresh"] = True

    def send(self, src_host: torch.Tensor, dst: torch.Tensor) -> None:
        """dst (device) <- src (host, pinned), not waited for (stream order keeps it before later launches)."""
        dst.copy_(src_host, non_blocking=True)
        self.link_bytes += src_host.numel() * src_host.element_size()


def _device_copy(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous().to(device)


def fuse_rows(parts: list) -> Mat:
    """q/k/v TierMatrices (one format) as one matrix: their tensors concatenated, the parts re-pointed at
    views of it (the tier's bytes stay as charged; the separate copies are freed)."""
    fmt = parts[0].fmt
    if any(p.fmt != fmt or p.cols != parts[0].cols for p in parts):
        raise GpuStepUnavailable("q/k/v in different formats")
    names = [n for n in ("data", "scale", "minimum") if getattr(parts[0], n) is not None]
    fused = {n: torch.cat([getattr(p, n) for p in parts]) for n in names}
    begin = 0
    for p in parts:
        for n in names:
            setattr(p, n, fused[n][begin:begin + p.rows])
        p._kernel = None
        begin += p.rows
    return Mat(fmt, begin, parts[0].cols, fused["data"], fused.get("scale"), fused.get("minimum"))


def check_model(model) -> None:
    """The model families the step covers: RMSNorm and rope (with Gemma 3's sandwich norms, q/k norms, local rope
    table and sliding windows), dense FFNs, power-of-two heads."""
    cfg = model.cfg
    why = None
    if cfg.norm != "rms":
        why = "layer norm"
    elif cfg.position != "rope":
        why = f"{cfg.position} positions"
    elif cfg.hidden_act not in SUPPORTED_ACTS:
        why = f"activation {cfg.hidden_act}"
    elif cfg.is_moe:
        why = "MoE layers"
    elif cfg.head_dim & (cfg.head_dim - 1) or cfg.num_heads % cfg.num_kv_heads:
        why = f"head_dim {cfg.head_dim} (the attention kernel reads power-of-two heads) or ungrouped heads"
    if why is not None:
        raise GpuStepUnavailable(f"no GPU step for this model: {why}")
