"""A predicted neuron's gate and up rows read as one contiguous pair (structs.pair_rows, predict.h paired_rows),
the huge-page arena that holds the step's own copies (native/arena.py), and gathered rows whose value does
not depend on where they fall in the list (the pass over pairs and the two separate passes must agree)."""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from helpers_fused import matvec
from online.execution.fused_decode import FusedDecodeStep
from online.kernels import native
from online.kernels.native.arena import HUGE_PAGE_BYTES, WeightArena
from online.kernels.native.structs import describe, pair_rows
from online.kernels.quantize import quantize, weight_from_gguf
from tandem.core.errors import TandemError
from tandem.core.generate import prefill
from tandem.core.kv_cache import KVCache
from test_fused_predict import PROMPT, packed, random_gates

Q = gguf.GGMLQuantizationType
ROWS, COLS = 24, 160


def _weight(fmt: str, seed: int):
    w = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)
    if fmt in ("Q4_0", "Q4_1", "Q8_0"):  # GGUF blocks, f16 scales read in place
        return weight_from_gguf(gguf.quants.quantize(w, getattr(Q, fmt)), fmt, (ROWS, COLS))
    return quantize(w, fmt)  # int4: float32 scales and minimums


def _gathered(lib, ref, rows, x: np.ndarray) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    out = np.zeros(len(rows), np.float32)
    lib.tdm_dot_rows_idx(ctypes.byref(ref.desc), rows.ctypes.data, len(rows), x.ctypes.data, 2.0, out.ctypes.data)
    return out


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "int4"])
def test_a_gathered_row_has_one_value_wherever_it_falls_in_the_list(fmt):
    lib = native.load_native().lib
    w = _weight(fmt, 0)
    ref, x = describe(w), np.random.default_rng(1).standard_normal(COLS).astype(np.float32)
    expected = matvec(w, torch.from_numpy(x), 2.0).numpy()  # block arithmetic on the quantized activation
    alone = np.array([_gathered(lib, ref, [r] * 4, x)[0] for r in range(ROWS)])  # each row inside a full group
    np.testing.assert_allclose(alone, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    for n in range(1, 10):  # lists ending in 0-3 rows past a group of four
        rows = np.random.default_rng(n).choice(ROWS, n, replace=False)
        np.testing.assert_array_equal(_gathered(lib, ref, rows, x), alone[rows])


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "int4", "int8"])
def test_paired_rows_equal_the_gate_and_up_rows_they_copy(fmt):
    lib = native.load_native().lib
    gate, up = describe(_weight(fmt, 2)), describe(_weight(fmt, 3))
    pair = pair_rows(gate, up, WeightArena())
    assert pair is not None and pair.desc.rows == 2 * ROWS and pair.desc.kind == gate.desc.kind
    x = np.random.default_rng(4).standard_normal(COLS).astype(np.float32)
    picked = np.sort(np.random.default_rng(5).choice(ROWS, 11, replace=False))
    both = _gathered(lib, pair, np.stack([2 * picked, 2 * picked + 1], 1).ravel(), x)  # [22]: gate, up, gate, ...
    np.testing.assert_array_equal(both[0::2], _gathered(lib, gate, picked, x))
    np.testing.assert_array_equal(both[1::2], _gathered(lib, up, picked, x))


def test_pair_rows_leaves_apart_what_it_cannot_pair():
    arena = WeightArena()
    q40, q80 = describe(_weight("Q4_0", 0)), describe(_weight("Q8_0", 1))
    assert pair_rows(q40, q80, arena) is None  # different kinds
    narrow = np.random.default_rng(2).standard_normal((ROWS, 64)).astype(np.float32)
    assert pair_rows(q40, describe(weight_from_gguf(gguf.quants.quantize(narrow, Q.Q4_0), "Q4_0", (ROWS, 64))), arena) is None
    fp32 = describe(quantize(narrow, "fp32"))
    assert pair_rows(fp32, fp32, arena) is None  # float32 rows: the layer's two matrices stay


def test_weight_arena_hands_out_aligned_disjoint_arrays():
    arena = WeightArena(chunk_bytes=1)  # rounded up to one 2 MiB chunk
    assert arena.chunk_bytes == HUGE_PAGE_BYTES and not arena.can_allocate(1)
    a = arena.empty((3, 5), np.float32)
    assert arena.can_allocate(1000) and not arena.can_allocate(HUGE_PAGE_BYTES)
    b = arena.copy(np.arange(7, dtype=np.int16))
    big = arena.allocate(3 * HUGE_PAGE_BYTES)  # larger than a chunk: a mapping of its own
    for arr in (a, b, big):
        assert arr.ctypes.data % 64 == 0 and arr.flags.c_contiguous
    a[...] = 1.5
    big[:] = 7
    np.testing.assert_array_equal(b, np.arange(7))  # untouched by its neighbours
    assert float(a.sum()) == 22.5 and b.ctypes.data >= a.ctypes.data + a.nbytes
    assert big.ctypes.data % HUGE_PAGE_BYTES == 0  # a fresh mapping starts on a 2 MiB boundary
    assert arena.used_bytes == a.nbytes + b.nbytes + big.nbytes
    with pytest.raises(TandemError):
        arena.allocate(-1)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("act", ["relu", "silu"])
def test_fused_step_reads_predicted_gate_and_up_as_pairs(tiny_model_dir, act, fmt):
    """Every predictor layer gets a pair; its logits equal those of the gate and up passes apart, bit for bit."""
    folder, _ = tiny_model_dir("llama-relu")
    model, executor = packed(folder, act, predictors=random_gates(64, 128, 2), fmt=fmt)
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    preds = [layer.pred.contents for layer in step._layers if layer.pred]
    assert len(preds) == 2 and all(p.gate_up.data and p.gate_up.rows == 2 * 128 for p in preds)

    def run(paired: bool):
        for p, d in zip(preds, saved):
            p.gate_up.data = d if paired else None
        cache = KVCache(model.cfg, 32)
        prefill(model, executor, cache, PROMPT)
        before = step.predictor_rows()
        out = torch.stack([step(tok, len(PROMPT) + i, cache) for i, tok in enumerate((3, 99, 4, 8))])
        rows = step.predictor_rows()
        return out, rows[0] - before[0], rows[1] - before[1]

    saved = [p.gate_up.data for p in preds]
    from online.step_inventory import step_units
    ffn_units = [u for u in step_units(step, model.cfg) if u.role in ("gate", "up")]
    assert len(ffn_units) == 4 and all(u.paired for u in ffn_units)  # the cost model prices the pair's reads
    preds[0].gate_up.data = None
    assert [u.paired for u in step_units(step, model.cfg) if u.role in ("gate", "up")] == [False, False, True, True]
    (apart, predicted_a, computed_a), (paired, predicted_p, computed_p) = run(False), run(True)
    torch.testing.assert_close(paired, apart, rtol=0, atol=0)
    assert predicted_p == predicted_a > 0
    assert computed_p == predicted_p  # a pair reads every predicted row's up
    assert computed_a <= predicted_a
