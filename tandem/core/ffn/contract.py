"""The executor contract: what the model, the Engine and the profilers need from an FFN executor.

The model calls ``forward`` for each FFN / MoE block and ``output_logits`` for the head. The Engine asks
``packed`` (whether packed CPU kernels run the FFN: they parallelise themselves, so torch's small ops
get one thread, and the fused C decode step may apply), ``ffn_nbytes`` / ``head_nbytes`` (weight bytes
read per token) and, for runtimes that count what they did, ``counters_snapshot`` and ``run_stats``.
DenseExecutor is the exact reference and the plainest implementation; online.execution.hybrid.HybridExecutor
is the packed one.

Example::

    def describe(executor: Executor) -> str:
        return f"{type(executor).__name__}: {executor.ffn_nbytes} FFN bytes, packed={executor.packed}"
    isinstance(DenseExecutor(cfg, layers), Executor)  # True (runtime_checkable)
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..config import ModelConfig


@runtime_checkable
class Executor(Protocol):
    cfg: ModelConfig

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] (the normalized FFN input) -> [T, d]."""

    def output_logits(self, x: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> logits [T, vocab]; ``lm_head_weight`` is the model's float head."""

    @property
    def packed(self) -> bool:
        """True when packed CPU kernels compute the FFN (hybrid executors)."""

    @property
    def ffn_nbytes(self) -> int:
        """FFN weight bytes read per token (all layers)."""

    @property
    def head_nbytes(self) -> int | None:
        """Bytes of the output head this executor reads; None: the model's float head."""

    def counters_snapshot(self) -> dict[str, float] | None:
        """Cumulative counters (neurons, bytes moved, predictor time, tier and expert-cache counters);
        None when the executor counts nothing."""

    def run_stats(self, delta: dict[str, float], steps: int, forward_steps: int, elapsed_s: float) -> dict:
        """Stats of one generation from the counters' change: ``steps`` tokens through the FFN (prompt +
        decoded), ``forward_steps`` forward calls (prefill + each decode step), ``elapsed_s`` wall time."""
