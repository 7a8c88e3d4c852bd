"""Named model shapes for ``tandem synth``: real architectures' dimensions, scaled variants, tiny test shapes.

Every shape is written in llama.cpp's ``llama`` layout (RMSNorm, RoPE, gated FFN), so llama.cpp runs
the same file. ``opt-6.7b`` keeps OPT-6.7B's dimensions (hidden 4096, 32 layers, FFN 16384, vocabulary
50272 -> the tokenizer's) but not its LayerNorm / learned positions / ungated FFN: llama.cpp has no OPT
architecture. The vocabulary is always the tokenizer's (SmolLM2's 49152 tokens by default).

Example::

    SHAPES["llama-1b"].n_ff          # 8192
    SHAPES["llama-2-7b"].params(49152)
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.core.errors import TandemError


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    n_ff: int
    n_experts: int = 0          # 0: dense FFN
    n_experts_used: int = 0
    rope_theta: float = 10000.0
    context: int = 4096
    note: str = ""

    def __post_init__(self) -> None:
        if self.hidden % self.n_heads or self.n_heads % self.n_kv_heads:
            raise TandemError(f"shape {self.name}: heads do not divide the hidden size / group")
        if self.hidden % 64 or self.n_ff % 32:
            raise TandemError(f"shape {self.name}: hidden must be a multiple of 64 and FFN of 32")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def params(self, vocab: int) -> int:
        """Parameter count with untied embeddings and ``vocab`` tokens."""
        d, kv = self.hidden, self.n_kv_heads * self.head_dim
        ffn = 3 * d * self.n_ff * max(1, self.n_experts) + d * self.n_experts
        return self.n_layers * (2 * d * d + 2 * d * kv + ffn + 2 * d) + 2 * vocab * d + d


SHAPES = {s.name: s for s in (
    Shape("llama-2-7b", 4096, 32, 32, 32, 11008, note="Llama-2-7B dimensions"),
    Shape("llama-2-13b", 5120, 40, 40, 40, 13824, note="Llama-2-13B dimensions"),
    Shape("opt-6.7b", 4096, 32, 32, 32, 16384, context=2048,
          note="OPT-6.7B dimensions in the llama layout (RMSNorm, RoPE, gated FFN)"),
    Shape("mixtral-8x7b", 4096, 32, 32, 8, 14336, n_experts=8, n_experts_used=2, rope_theta=1e6,
          note="Mixtral-8x7B dimensions"),
    Shape("llama-3b", 3072, 28, 24, 8, 8192, note="Llama-3.2-3B-like dimensions"),
    Shape("llama-1b", 2048, 16, 32, 8, 8192, note="Llama-3.2-1B-like dimensions"),
    Shape("llama-350m", 1024, 24, 16, 16, 4096, note="a 350M-parameter Llama"),
    Shape("tiny", 128, 2, 4, 2, 512, context=512, note="test shape"),
    Shape("tiny-moe", 128, 2, 4, 2, 256, n_experts=4, n_experts_used=2, context=512, note="test shape"),
    Shape("mixtral-650m", 1024, 8, 16, 4, 2816, n_experts=8, n_experts_used=2, rope_theta=1e6,
          note="a Mixtral-shaped MoE that fits this machine: 8 layers of 8 experts, top 2"),
)}


def get_shape(name: str) -> Shape:
    shape = SHAPES.get(name.strip().lower())
    if shape is None:
        raise TandemError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    return shape
