"""Q5_0 / Q6_K / Q5_K blocks read in place (native/kquants.h, superblocks.GGUFBlockWeight): the bytes are
the file's, every weight equals gguf's decode, the C row dots equal the stated integer arithmetic
(tails, chunk carry-over, subnormal and extreme scales), multi-token rows equal single-token rows bit
for bit, and the fused step with these blocks (dense GGUF down included) equals its torch statement,
the module path, and its own multi-token form."""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from helpers_fused import matvec
from online.kernels import native
from online.kernels.cpu_kernels import dequantize_into, gemv_rows, kernel_weight
from online.kernels.native.structs import describe
from online.kernels.quantize import weight_from_gguf
from online.kernels.superblocks import GGUFBlockWeight
from tandem.core.errors import TandemError
from test_kquants import random_blocks

Q = gguf.GGMLQuantizationType
QTYPES = ["Q5_0", "Q6_K", "Q5_K"]
SHAPES = ((11, 768), (5, 2304))  # a tail of 3 rows; 72 blocks of 32: the multi-token kernel's chunks carry over
SCALES = np.array([6.1e-5, 3e-5, 0.02, -0.5, 7.0, 1e3, 6e-8, 0.1], np.float32)  # normal, subnormal, large


def _raw(qtype: str, rows: int, cols: int, seed: int = 0, scales=SCALES) -> np.ndarray:
    return random_blocks(qtype, rows, cols, np.random.default_rng(seed), scales)


def _x(T: int, cols: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((T, cols)).astype(np.float32)
    x[:, 37] = 40.0 * (1 + np.arange(T))  # outlier blocks (the residual pass)
    return x


@pytest.mark.parametrize("qtype", QTYPES)
def test_blocks_keep_gguf_bytes_and_values(qtype):
    rows, cols = SHAPES[0]
    raw = _raw(qtype, rows, cols)
    w = weight_from_gguf(raw, qtype, (rows, cols))
    assert isinstance(w, GGUFBlockWeight) and w.nbytes == raw.nbytes and w.shape == (rows, cols)
    ref = gguf.quants.dequantize(raw, getattr(Q, qtype)).reshape(rows, cols)
    assert np.array_equal(w.dequantize(), ref)
    ref_c = kernel_weight(w)
    assert np.array_equal(dequantize_into(ref_c, np.zeros((rows, cols), np.float32)), ref)  # kquants.h decode
    x = _x(3, cols)
    y = gemv_rows(ref_c, None, x, np.empty((3, rows), np.float32), 2)  # the module kernels' float-activation rows
    np.testing.assert_allclose(y, x @ ref.T, rtol=1e-4, atol=1e-4)
    with pytest.raises(TandemError, match="row-dot"):
        describe(w, dot_input=False)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("ratio", [-1.0, 2.0])
def test_row_dots_equal_the_integer_arithmetic(qtype, ratio):
    lib = native.load_native().lib
    for rows, cols in SHAPES:
        w = weight_from_gguf(_raw(qtype, rows, cols, 3), qtype, (rows, cols))
        d = describe(w)
        x = _x(1, cols)[0]
        ref = matvec(w, torch.from_numpy(x), ratio).double().numpy()  # [rows]
        scale = np.abs(w.dequantize()).astype(np.float64) @ np.abs(x)
        for r0, n in ((0, rows), (1, rows - 1), (rows - 3, 3)):
            got = np.zeros(n, np.float32)
            lib.tdm_dot_rows(ctypes.byref(d.desc), r0, n, x.ctypes.data, ratio, got.ctypes.data)
            assert (np.abs(got - ref[r0:r0 + n]) <= 1e-5 * scale[r0:r0 + n]).all(), (rows, r0, n)


@pytest.mark.parametrize("qtype", QTYPES)
def test_multi_token_rows_equal_single_token_rows(qtype):
    lib = native.load_native().lib
    for rows, cols in SHAPES:
        d = describe(weight_from_gguf(_raw(qtype, rows, cols, 5), qtype, (rows, cols)))
        for T in (2, 5):
            x = _x(T, cols, 6)
            for r0, n in ((0, rows), (1, rows - 2)):
                got = np.zeros((T, n), np.float32)
                lib.tdm_dot_rows_multi(ctypes.byref(d.desc), r0, n, T, x.ctypes.data, 2.0, got.ctypes.data)
                for i in range(T):
                    want = np.zeros(n, np.float32)
                    lib.tdm_dot_rows(ctypes.byref(d.desc), r0, n, x[i].ctypes.data, 2.0, want.ctypes.data)
                    assert np.array_equal(got[i], want), (cols, T, r0, n, i)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A one-layer Llama with in_features 256 everywhere (k-quant super-blocks fit)."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("wide-llama")
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


# per-type f16 scales giving weights of ~0.05 (Q6_K's int8 sub-block scales and Q5_K's 6-bit ones multiply in)
BLOCK_SCALE = {"Q5_0": 0.004, "Q6_K": 2e-5, "Q5_K": 1e-4}


@pytest.mark.parametrize("qtype", QTYPES)
def test_fused_step_on_in_place_blocks(wide_llama, qtype):
    from helpers_fused import reference_step
    from online.execution.fused_decode import FusedDecodeStep
    from online.execution.quantized_linear import QuantizedLinearModule
    from online.kernels.ffn import QuantizedFFN, QuantizedLinear
    from tandem.core.generate import decode_one_token
    from tandem.core.kv_cache import KVCache
    from test_fused_decode import packed

    model, executor = packed(wide_llama, "int8", thresholds=[0.02])
    seeds = iter(range(10, 20))

    def blocks(rows: int, cols: int) -> GGUFBlockWeight:
        s = np.array([BLOCK_SCALE[qtype], -BLOCK_SCALE[qtype] / 2], np.float32)
        return weight_from_gguf(_raw(qtype, rows, cols, next(seeds), s), qtype, (rows, cols))

    attn = model.layers[0].self_attn
    attn.qkv_proj = QuantizedLinearModule(QuantizedLinear(blocks(512, 256)))  # q 256 + k 128 + v 128
    attn.o_proj = QuantizedLinearModule(QuantizedLinear(blocks(256, 256)))
    split = executor.splits[0]
    split.cpu = QuantizedFFN(up=blocks(256, 256), down_t=None, gate=blocks(256, 256), down=blocks(256, 256),
                             act="silu", threads=2)
    step = FusedDecodeStep.build(model, executor, residual_ratio=2.0)
    layer = step._layers[0]
    assert layer.qkv.kind == layer.up.kind == layer.down.kind == {"Q5_0": 8, "Q6_K": 9, "Q5_K": 10}[qtype]
    prompt = [3, 17, 42, 5, 9, 33]
    cache, ref_cache, module_cache = (KVCache(model.cfg, 16) for _ in range(3))
    for pos, tok in enumerate(prompt):
        got = step(tok, pos, cache)
        ref, _ = reference_step(model, executor, ref_cache, tok, pos, residual_ratio=2.0)
        torch.testing.assert_close(got, ref.float(), rtol=1e-3, atol=1e-3)
        module = decode_one_token(model, executor, module_cache, tok, pos)  # C module kernels, dense down
        torch.testing.assert_close(got, module, rtol=3e-2, atol=3e-2)
    single, multi = KVCache(model.cfg, 16), KVCache(model.cfg, 16)
    want = torch.stack([step(t, pos, single) for pos, t in enumerate(prompt)])
    assert torch.equal(step.step_many(prompt, 0, multi), want)


def _q4_1_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_1 blocks (f16 d, f16 m, 16 nibble bytes per 32 weights) [rows, cols / 32 * 20]."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 32, 20), dtype=np.uint8)
    blocks[:, 0:2] = np.full(len(blocks), 0.004, np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = np.full(len(blocks), -0.03, np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("down_qtype", ["Q6_K", "Q4_1"])
def test_a_dense_down_layer_computes_every_neuron(down_qtype):
    """A layer whose down projection is read dense in its GGUF blocks reads every down row anyway, so
    the split drops the magnitude threshold: every neuron is computed, and the FFN equals the
    threshold-free one (a thresholded Q5_0 / Q6_K layer would lose quality for no bytes)."""
    from types import SimpleNamespace
    from online.execution.hybrid import ExecutionSettings, _split_layer
    from tandem.core.ffn.weights import FFNWeights
    from tandem.core.loading.checkpoint import RawQuantTensor

    d, n_ff = 256, 512
    s5, s6 = (np.array([BLOCK_SCALE[q], -BLOCK_SCALE[q] / 2], np.float32) for q in ("Q5_0", "Q6_K"))
    raw = {f"model.layers.0.mlp.{name}_proj.weight": RawQuantTensor(q, shape, _raw(q, *shape, seed, scales))
           for name, q, shape, seed, scales in (("up", "Q5_0", (n_ff, d), 3, s5), ("gate", "Q5_0", (n_ff, d), 4, s5))}
    down = _raw("Q6_K", d, n_ff, 5, s6) if down_qtype == "Q6_K" else _q4_1_blocks(d, n_ff, 5)
    raw["model.layers.0.mlp.down_proj.weight"] = RawQuantTensor(down_qtype, (d, n_ff), down)
    w = FFNWeights(up=torch.zeros(n_ff, d), down=torch.zeros(d, n_ff), gate=torch.zeros(n_ff, d))
    cfg = SimpleNamespace(hidden_act="silu", act_threshold=0.0)
    split = _split_layer(cfg, 0, w, torch.zeros(0, dtype=torch.long), 0.05, None, None,
                         ExecutionSettings(weight_format="int8", threads=2), raw)
    assert split.cpu.down is not None and split.cpu.down_t is None
    assert split.threshold < 0
    x = _x(3, d)
    y, used = split.cpu.forward_numpy(x, threshold=split.threshold)
    dense, _ = split.cpu.forward_numpy(x, threshold=-1.0)
    assert used == 3 * n_ff
    np.testing.assert_array_equal(y, dense)


@pytest.mark.parametrize("predicted_sparsity, dense", [(0.3, True), (0.5, True), (0.9, False), (None, False)])
def test_a_relu_layer_reads_its_down_whole_when_its_predictor_marks_most_rows(predicted_sparsity, dense):
    """A predictor layer whose active rows (fp16 down rows: 2 bytes a weight) would read more than the whole
    Q4_1 down (0.625) keeps the GGUF blocks for one dense product; at 90% sparsity, or with no predictor
    record, the sparse rows stay. Either way the predicted rows' FFN equals the float reference."""
    from types import SimpleNamespace
    from online.execution.hybrid import ExecutionSettings, _split_layer
    from tandem.core.ffn.weights import FFNWeights
    from tandem.core.loading.checkpoint import RawQuantTensor

    d, n_ff = 256, 512
    s5 = np.array([BLOCK_SCALE["Q5_0"], -BLOCK_SCALE["Q5_0"] / 2], np.float32)
    raw = {f"model.layers.0.mlp.{name}_proj.weight": RawQuantTensor("Q5_0", shape, _raw("Q5_0", *shape, seed, s5))
           for name, shape, seed in (("up", (n_ff, d), 3), ("gate", (n_ff, d), 4))}
    raw["model.layers.0.mlp.down_proj.weight"] = RawQuantTensor("Q4_1", (d, n_ff), _q4_1_blocks(d, n_ff, 5))
    w = FFNWeights(up=torch.zeros(n_ff, d), down=torch.zeros(d, n_ff), gate=torch.zeros(n_ff, d))
    stats = {} if predicted_sparsity is None else {"predicted_sparsity": predicted_sparsity}
    predictor = SimpleNamespace(pset=SimpleNamespace(entry=lambda layer: SimpleNamespace(stats=stats)), layer=0)
    split = _split_layer(SimpleNamespace(hidden_act="relu", act_threshold=0.0), 0, w, torch.zeros(0, dtype=torch.long),
                         0.0, predictor, None, ExecutionSettings(weight_format="int8", down_format="fp16", threads=2), raw)
    assert (split.cpu.down is not None) == dense and (split.cpu.down_t is None) == dense
    x = _x(1, d)
    rows = np.sort(np.random.default_rng(6).choice(n_ff, 200, replace=False)).astype(np.int64)
    y, _ = split.cpu.forward_numpy(x, threshold=split.threshold, rows=rows)
    deq = {name: gguf.quants.dequantize(raw[f"model.layers.0.mlp.{name}_proj.weight"].data,
                                        getattr(gguf.GGMLQuantizationType, q)).reshape(shape)
           for name, q, shape in (("up", "Q5_0", (n_ff, d)), ("gate", "Q5_0", (n_ff, d)), ("down", "Q4_1", (d, n_ff)))}
    h = np.zeros(n_ff, np.float64)
    h[rows] = np.maximum(deq["gate"][rows] @ x[0].astype(np.float64), 0.0) * (deq["up"][rows] @ x[0].astype(np.float64))
    ref = deq["down"] @ h  # [d]
    np.testing.assert_allclose(y[0], ref, rtol=0, atol=0.02 * np.abs(ref).max())
