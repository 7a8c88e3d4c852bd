"""VNNI's int8 block dots (rows.h's TDM_VNNI: vpdpbusd) and AMX's Q8_0 tile products (blocks_amx.h, 8 tokens
and more) against the AVX2 build of the same sources: every row, multi-token product and whole decode step
gives the same bits, since all of them sum the block products as exact integers. On a CPU without VNNI the
default build is the AVX2 one and this module is skipped (every other kernel test then runs that path)."""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from bench.native_ab import use_library
from online.execution.fused_decode import FusedDecodeStep
from online.kernels import native
from online.kernels.native.structs import describe, interleave
from online.kernels.quantize import weight_from_gguf
from tandem.core.kv_cache import KVCache
from test_fused_decode import packed

NO_VNNI = ("-mno-avx512vnni", "-mno-avxvnni", "-mno-amx-tile", "-mno-amx-int8")  # the AVX2 kernels alone
pytestmark = pytest.mark.skipif(not native.load_native().has_vnni, reason="this CPU has no VNNI: one build only")


@pytest.fixture(scope="module")
def libs():
    plain = native.load_native(NO_VNNI)
    assert plain.has_avx2 and not plain.has_vnni and not plain.has_amx
    return native.load_native(), plain


def _weight(qtype: str, rows: int, cols: int):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * np.logspace(-3, 3, rows).astype(np.float32)[:, None]
    w[1, :32] = 0.0
    raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))  # uint8 [rows, blocks * bytes]
    if qtype == "Q8_0":  # -128 codes (gguf's quantizer stops at -127): |w| = 128 as an unsigned byte
        raw[4, 34 + 2:34 + 34:3] = 0x80
    return weight_from_gguf(raw, qtype, (rows, cols))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("ratio", [-1.0, 0.0])  # 0: a residual on every block
@pytest.mark.parametrize("cols", [608, 1088])  # 19 and 34 blocks: one batch of AMX sums, and two
def test_rows_and_multi_token_products_equal_the_avx2_build(libs, qtype, ratio, cols):
    """Rows 1..66: an edge row run, seven whole groups of eight (three AMX pairs of Q4 groups and an odd one on the
    vector kernel; seven Q8_0 groups), two edge rows."""
    rows = 67
    w = _weight(qtype, rows, cols)
    for T in (1, 3, 8, 13, 16, 37):  # AMX (where the CPU has it) from 8: one tile chunk, two, three overlapping
        x = np.random.default_rng(T).standard_normal((T, cols)).astype(np.float32) * 3
        x[:, 100] = 127.0  # codes at +-127
        picked = np.random.default_rng(T).permutation(rows)[:9].astype(np.int32)
        outs = []
        for lib in libs:
            got = []
            for ref in (describe(w), interleave(describe(w), lib.lib)):  # GGUF's blocks in place; 8 rows interleaved
                d = ctypes.byref(ref.desc)
                out = np.zeros(T * (rows - 1), np.float32)
                lib.lib.tdm_dot_rows_multi(d, 1, rows - 1, T, x.ctypes.data, ratio, out.ctypes.data)
                single, gathered = np.zeros(rows, np.float32), np.zeros(picked.size, np.float32)
                lib.lib.tdm_dot_rows(d, 0, rows, x[0].ctypes.data, ratio, single.ctypes.data)
                lib.lib.tdm_dot_rows_idx(d, picked.ctypes.data, picked.size, x[0].ctypes.data, ratio,
                                         gathered.ctypes.data)
                got += [out, single, gathered]
            outs.append(got)
        assert all(np.array_equal(a, b) for a, b in zip(*outs)), T
        assert np.abs(outs[0][1]).max() > 0
    if libs[0].has_amx and libs[0].lib.tdm_amx_state() != 1:  # the comparisons above then never met a tile
        pytest.skip("AMX built, but Linux refused this process the tile state (or TANDEM_AMX=0): vector kernels only")


@pytest.mark.parametrize("fmt, thresholds", [("int4", None), ("int8", None), ("int4", [0.02] * 2)])
def test_decode_steps_equal_the_avx2_build(libs, tiny_model_dir, fmt, thresholds):
    """Single steps and a multi-token call: int4 / int8 weights, dense and with a threshold's gathered rows."""
    model, executor = packed(tiny_model_dir("llama")[0], fmt, thresholds=thresholds)
    step = FusedDecodeStep.build(model, executor)
    tokens = [(29 * i + 3) % model.cfg.vocab_size for i in range(12)]
    got = []
    for lib in libs:
        use_library(step, lib)
        cache = KVCache(model.cfg, len(tokens))
        first = step.step_many(tokens[:8], 0, cache)  # [8, vocab]
        rest = torch.stack([step(t, 8 + i, cache) for i, t in enumerate(tokens[8:])])
        got.append((first, rest, cache.keys.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_smollm2_steps_equal_the_avx2_build(libs, smollm2_int4_engine):
    """SmolLM2's GGUF (Q4_1 rows, a Q8_0 output layer: AMX's tiles from 8 tokens where the CPU has them):
    a 12-token multi-token call and the single steps after it give the same logits as the AVX2 build."""
    engine = smollm2_int4_engine
    step, original = engine.compiled_decode, engine.compiled_decode.native
    tokens = [1, 504, 3250, 28, 9, 2048, 77, 610, 12, 4001, 5, 33, 19000, 8]
    got = []
    try:
        for lib in libs:
            use_library(step, lib)
            cache = KVCache(engine.model.cfg, len(tokens))
            many = step.step_many(tokens[:12], 0, cache)  # [12, vocab]
            got.append((many, step(tokens[12], 12, cache), step(tokens[13], 13, cache)))
    finally:
        use_library(step, original)
    assert all(torch.equal(a, b) for a, b in zip(*got))
