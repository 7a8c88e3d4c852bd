"""Streaming GGUF output for ``tandem synth``: header up front, tensors one at a time, stats patched.

``tensor_plan`` lists every tensor (name, shape in torch order, GGUF type) in writing order;
``StreamingGGUF`` writes the header, then takes each tensor's blocks in that order (checking the
byte count), and ``patch_stats`` overwrites a reserved fixed-length header string with the measured
statistics (JSON padded with spaces) once all layers are written.

Example::

    with StreamingGGUF(path, spec, tokenizer_fields, tensor_plan(shape, 49152, "Q4_0")) as out:
        out.write(blocks)          # uint8 blocks of the next tensor in the plan
        out.patch_stats({...})
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tandem.core.errors import TandemError

from tandem.core.loading.quants import row_nbytes

STATS_KEY = "tandem.synth.stats"
STATS_BYTES = 4096
_PLACEHOLDER = "#tandem-synth-stats-pending#"
_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3}


def tensor_plan(shape, vocab: int, qtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    d, hd = shape.hidden, shape.head_dim
    plan = [("token_embd.weight", (vocab, d), qtype)]
    for i in range(shape.n_layers):
        b = f"blk.{i}"
        plan += [(f"{b}.attn_norm.weight", (d,), "F32"), (f"{b}.attn_q.weight", (shape.n_heads * hd, d), qtype),
                 (f"{b}.attn_k.weight", (shape.n_kv_heads * hd, d), qtype),
                 (f"{b}.attn_v.weight", (shape.n_kv_heads * hd, d), qtype),
                 (f"{b}.attn_output.weight", (d, shape.n_heads * hd), qtype), (f"{b}.ffn_norm.weight", (d,), "F32")]
        if shape.n_experts:
            E = shape.n_experts
            plan += [(f"{b}.ffn_gate_inp.weight", (E, d), "F32"),
                     (f"{b}.ffn_gate_exps.weight", (E, shape.n_ff, d), qtype),
                     (f"{b}.ffn_up_exps.weight", (E, shape.n_ff, d), qtype),
                     (f"{b}.ffn_down_exps.weight", (E, d, shape.n_ff), qtype)]
        else:
            plan += [(f"{b}.ffn_gate.weight", (shape.n_ff, d), qtype), (f"{b}.ffn_up.weight", (shape.n_ff, d), qtype),
                     (f"{b}.ffn_down.weight", (d, shape.n_ff), qtype)]
    plan += [("output_norm.weight", (d,), "F32"), ("output.weight", (vocab, d), qtype)]
    return plan


def _byte_shape(shape: tuple[int, ...], qtype: str) -> tuple[int, ...]:
    return (*shape[:-1], row_nbytes(qtype, shape[-1]))


class StreamingGGUF:
    def __init__(self, path: Path, spec, tokenizer_fields: dict, plan: list) -> None:
        from gguf import GGMLQuantizationType, GGUFWriter

        self.path, self.plan, self._next = Path(path), plan, 0
        shape = spec.shape
        w = GGUFWriter(str(path), "llama")
        w.add_name(f"synthetic weights: {shape.name}")
        w.add_description(f"synthetic weights (random, ReLU-sparse by construction, not a trained model): "
                          f"{shape.note}; requested FFN sparsity {spec.sparsity:.0%}")
        w.add_file_type(_FILE_TYPES[spec.qtype])
        w.add_context_length(shape.context)
        w.add_embedding_length(shape.hidden)
        w.add_block_count(shape.n_layers)
        w.add_feed_forward_length(shape.n_ff)
        w.add_head_count(shape.n_heads)
        w.add_head_count_kv(shape.n_kv_heads)
        w.add_rope_freq_base(shape.rope_theta)
        w.add_rope_dimension_count(shape.head_dim)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(len(tokenizer_fields["tokenizer.ggml.tokens"]))
        if shape.n_experts:
            w.add_expert_count(shape.n_experts)
            w.add_expert_used_count(shape.n_experts_used)
        _copy_tokenizer(w, tokenizer_fields)
        w.add_string("tandem.activation", "relu")
        w.add_bool("tandem.synthetic", True)
        w.add_string("tandem.synth.request", json.dumps(spec.request()))
        w.add_string(STATS_KEY, _PLACEHOLDER.ljust(STATS_BYTES))
        for name, tshape, qtype in plan:
            bshape = _byte_shape(tshape, qtype)
            w.add_tensor_info(name, bshape, np.dtype(np.uint8), int(np.prod(bshape)), GGMLQuantizationType[qtype])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self._writer = w

    def __enter__(self) -> "StreamingGGUF":
        return self

    def __exit__(self, *exc) -> None:
        self._writer.close()

    def write(self, blocks: np.ndarray) -> None:
        """The next tensor's bytes (uint8 or float32 array of exactly the planned size)."""
        name, tshape, qtype = self.plan[self._next]
        data = np.ascontiguousarray(blocks).view(np.uint8)
        if data.nbytes != int(np.prod(_byte_shape(tshape, qtype))):
            raise TandemError(f"internal: {name} has {data.nbytes} bytes, planned {_byte_shape(tshape, qtype)}")
        self._writer.write_tensor_data(data)
        self._next += 1

    def patch_stats(self, summary: dict) -> None:
        """Overwrite the reserved header string with the statistics (after every tensor is written)."""
        if self._next != len(self.plan):
            raise TandemError(f"internal: {len(self.plan) - self._next} tensors not written")
        text = json.dumps(summary, separators=(",", ":"))
        if len(text) > STATS_BYTES:
            raise TandemError("internal: synthetic statistics do not fit the reserved header space")
        self._writer.fout[0].flush()
        with open(self.path, "r+b") as f:
            head = f.read(1 << 24)  # the header (vocabulary included) is a few MB
            at = head.find(_PLACEHOLDER.encode())
            if at < 0:
                raise TandemError("internal: statistics placeholder not found in the GGUF header")
            f.seek(at)
            f.write(text.ljust(STATS_BYTES).encode())


def _copy_tokenizer(w, fields: dict) -> None:
    for key, value in fields.items():
        if not (key.startswith("tokenizer.")):
            continue
        if isinstance(value, list):
            if not value:
                continue
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
