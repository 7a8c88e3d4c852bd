"""The GPU step's Triton kernels against their torch twins (online/gpu/ops.py), every tier format.

On a machine with CUDA the kernels run there; elsewhere through Triton's interpreter on CPU tensors
(skipped where Triton is not installed: it is not a test dependency, the GPU machine has it)."""
import os

import pytest
import torch

_INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _INTERPRET:  # read when the kernels are decorated (their import), then put back for the other tests
    os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton")
    import online.gpu.kernels  # noqa: E402,F401
finally:
    if _INTERPRET:
        del os.environ["TRITON_INTERPRET"]

from online.execution.gpu_tier import GpuTier  # noqa: E402
from online.execution.tier_matrix import TierMatrix  # noqa: E402
from online.gpu.ops import Mat, Ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """Triton's interpreter reads the variable at each launch too: set for this module's tests only."""
    if _INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
FORMATS = ("fp32", "fp16", "q8", "q4", "q4_1")


def _mat(rows: int, cols: int, fmt: str, seed: int) -> Mat:
    g = torch.Generator().manual_seed(seed)
    tier = GpuTier(DEVICE, 1 << 30)
    return Mat.of(TierMatrix.pack(torch.randn(rows, cols, generator=g), fmt, tier, f"m{seed}"))


def _both():
    return Ops("triton"), Ops("torch")


def test_default_matvec_launch_shapes_and_their_checks():
    """The launch shapes the GPU step was measured with (rows per program by matrix height, 128-column tiles, four
    warps, the column loop unrolled); a shape that is not a power of two is refused before any compile."""
    from online.gpu.ops import MatvecLaunch, default_matvec_launch
    from tandem.core.errors import TandemError
    assert default_matvec_launch(576, 576) == MatvecLaunch(4, 128, 4, False)
    assert default_matvec_launch(8192, 2048) == MatvecLaunch(8, 128, 4, False)
    assert default_matvec_launch(49152, 2048) == MatvecLaunch(16, 128, 4, False)
    assert default_matvec_launch(64, 96) == MatvecLaunch(4, 128, 4, False)  # a tile wider than the row: capped at launch
    with pytest.raises(TandemError, match="power of two"):
        MatvecLaunch(3, 128)


def _rolled(rows, cols):
    from online.gpu.ops import MatvecLaunch
    return MatvecLaunch(rows_per_program=2, cols_per_tile=64, warps=2, rolled=True)


def _packed(rows, cols):
    from online.gpu.ops import MatvecLaunch
    return MatvecLaunch(rows_per_program=4, cols_per_tile=64, warps=2, rolled=True, packed=True)


def _words(rows, cols):
    from online.gpu.ops import MatvecLaunch
    return MatvecLaunch(rows_per_program=4, cols_per_tile=64, warps=2, words=True)


@pytest.mark.parametrize("launch,fmt", [(launch, fmt) for launch in (None, _rolled, _packed, _words) for fmt in FORMATS
                                        if launch is not _words or fmt in ("q8", "q4", "q4_1")],
                         ids=lambda v: getattr(v, "__name__", str(v)).strip("_") if v is not None else "default")
@pytest.mark.parametrize("cols", [96, 320])  # one column block, and three (the last partial)
def test_matvec_every_format_with_norm_bias_residual(fmt, cols, launch):
    tri, ref = Ops("triton", matvec_launch=launch), Ops("torch")
    w = _mat(37, cols, fmt, 1)
    x = torch.randn(cols, device=DEVICE)
    norm, bias, res = torch.rand(cols, device=DEVICE) + 0.5, torch.randn(37, device=DEVICE), torch.randn(37, device=DEVICE)
    outs = []
    for ops in (tri, ref):
        y = torch.zeros(37, device=DEVICE)
        ops.matvec(x, w, y, norm=norm, eps=1e-5, b1=bias, residual=res)
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    # and the torch twin is W @ rmsnorm(x) + b + res by the tier's own dequantization
    dense = w.dequantize() @ (x * torch.rsqrt(x.pow(2).mean() + 1e-5) * norm) + bias + res
    torch.testing.assert_close(outs[1], dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("launch", [None, _rolled, _packed, _words], ids=["default", "rolled", "packed", "words"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "relu", "gelu"])
def test_gated_pair_in_mixed_formats(act, launch):
    tri, ref = Ops("triton", matvec_launch=launch), Ops("torch")
    up, gate = _mat(70, 64, "q4_1", 2), _mat(70, 64, "q8", 3)
    x = torch.randn(64, device=DEVICE)
    outs = []
    for ops in (tri, ref):
        y = torch.zeros(70, device=DEVICE)
        ops.matvec(x, up, y, w2=gate, act=act)
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cols", [80, 320])  # a padded last block, and five blocks over two 128-column tiles
@pytest.mark.parametrize("formats", [("q4", "q4"), ("q4_1", "q4"), ("q4_1", "q4_1")])
def test_packed_q4_reads_equal_the_twin(formats, cols):
    """Q4 rows read as whole bytes (PACKED: each byte's two nibbles against their two columns) give the torch twin's
    result, alone and as a gated pair, with the norm."""
    from online.gpu.ops import MatvecLaunch
    tri = Ops("triton", matvec_launch=lambda r, c: MatvecLaunch(4, 128, 2, rolled=True, packed=True))
    ref = Ops("torch")
    up, gate = _mat(33, cols, formats[0], 7), _mat(33, cols, formats[1], 8)
    x, norm = torch.randn(cols, device=DEVICE), torch.rand(cols, device=DEVICE) + 0.5
    for w2 in (None, gate):
        outs = []
        for ops in (tri, ref):
            y = torch.zeros(33, device=DEVICE)
            ops.matvec(x, up, y, norm=norm, eps=1e-5, w2=w2, act="silu" if w2 is not None else "none")
            outs.append(y)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("formats,cols,rolled", [  # cols: a padded last block; 17 blocks over 3 tiles
    *[(f, c, False) for f in [("q4", "q4"), ("q4_1", "q4"), ("q4_1", "q4_1"), ("q8", "q8")] for c in (80, 544)],
    (("q4_1", "q4_1"), 544, True), (("q8", "q8"), 544, True)])
def test_word_reads_equal_the_twin(formats, cols, rolled):
    """Quantized rows read as 32-bit words (eight Q4 nibbles or four Q8_0 codes a load, gathered against their
    columns) give the torch twin's result, alone and as a gated pair, with the norm, bias and residual; the launch
    takes the word path for these formats (matvec_reads)."""
    from online.gpu.ops import MatvecLaunch, matvec_reads
    launch = MatvecLaunch(8, 256, 2, rolled=rolled, words=True)
    tri = Ops("triton", matvec_launch=lambda r, c: launch)
    ref = Ops("torch")
    up, gate = _mat(45, cols, formats[0], 7), _mat(45, cols, formats[1], 8)
    assert matvec_reads(launch, 256, up, gate)[0] == matvec_reads(launch, 256, up, up)[0] == "words"
    g = torch.Generator().manual_seed(cols)
    x, norm = torch.randn(cols, generator=g).to(DEVICE), (torch.rand(cols, generator=g) + 0.5).to(DEVICE)
    bias, res = torch.randn(45, generator=g).to(DEVICE), torch.randn(45, generator=g).to(DEVICE)
    for w2 in (None, gate):
        outs = []
        for ops in (tri, ref):
            y = res.clone()
            ops.matvec(x, up, y, norm=norm, eps=1e-5, w2=w2, b1=bias, act="silu" if w2 is not None else "none",
                       residual=y)
            outs.append(y)
        # float32 sums in another order: a gated pair's products reach thousands here
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5 * float(outs[1].abs().max()))


@pytest.mark.parametrize("formats", [("q4", "q8"), ("q8", "q4_1"), ("fp16", "q4")])
def test_word_reads_fall_back_for_mixed_pairs(formats):
    """A pair with no common word layout (Q4 and Q8_0, either way round; a float matrix) is read byte-wise under a
    words launch, and gives the twin's result."""
    from online.gpu.ops import MatvecLaunch, matvec_reads
    launch = MatvecLaunch(4, 64, 2, words=True)
    tri = Ops("triton", matvec_launch=lambda r, c: launch)
    up, gate = _mat(20, 96, formats[0], 2), _mat(20, 96, formats[1], 3)
    assert matvec_reads(launch, 64, up, gate)[0] == "bytes"
    x = torch.randn(96, device=DEVICE)
    outs = []
    for ops in (tri, Ops("torch")):
        y = torch.zeros(20, device=DEVICE)
        ops.matvec(x, up, y, w2=gate, act="silu")
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["q8", "q4_1"])  # (the Q8_0 and the nibble kernel)
def test_word_down_rows_over_several_steps_a_program(fmt):
    """300 neurons x 1,000 columns (a padded last block) with 64 columns and 16 rows a step a program: ten row
    slices of 32 rows (the last partial), two unrolled steps each, over 16 column blocks, added atomically."""
    from online.gpu.ops import MatvecTLaunch
    tri = Ops("triton", matvec_t_launch=lambda r, c: MatvecTLaunch(64, 16, 64, 2, words=True))
    w = _mat(300, 1000, fmt, 5)
    g = torch.Generator().manual_seed(1)
    h, start = torch.randn(300, generator=g).to(DEVICE), torch.randn(1000, generator=g).to(DEVICE)
    outs = []
    for ops in (tri, Ops("torch")):
        y = start.clone()
        ops.matvec_t(h, w, y)
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def _words_t(rows, cols):
    from online.gpu.ops import MatvecTLaunch
    return MatvecTLaunch(cols_per_program=32, rows_per_step=16, max_rows_per_program=32, warps=2, words=True)


@pytest.mark.parametrize("launch", [None, _words_t], ids=["default", "words"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_matvec_t_accumulates_down_rows(fmt, launch):
    """Down rows kept neuron-major, summed in row slices added atomically (with words: Q8_0 rows read as 32-bit
    words, four columns a word: seven slices of 16 rows, the last partial, over three column blocks)."""
    tri, ref = Ops("triton", matvec_t_launch=launch), Ops("torch")
    w = _mat(100, 96, fmt, 4)  # [neurons, d]
    h, bias, start = torch.randn(100, device=DEVICE), torch.randn(96, device=DEVICE), torch.randn(96, device=DEVICE)
    outs = []
    for ops in (tri, ref):
        y = start.clone()
        ops.matvec_t(h, w, y, bias=bias)
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[1], start + h @ w.dequantize() + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope,hd,qk_norm,window,heads", [
    (True, 16, False, 0, (6, 2)), (False, 16, False, 0, (6, 2)), (True, 64, False, 0, (6, 2)),
    (True, 32, True, 0, (6, 2)), (True, 32, True, 8, (6, 2)), (False, 16, True, 50, (6, 2)),
    (True, 256, True, 8, (4, 1))])  # the last: Gemma 3 270M's heads (one k/v head of 256)
def test_rope_kv_write_then_attention(rope, hd, qk_norm, window, heads):
    """Per-head q/k norms (Qwen3, Gemma 3) and sliding windows (8 rows; 50 > pos: all) included."""
    tri, ref = _both()
    (H, KV), cap = heads, 40
    g = torch.Generator().manual_seed(5)
    past_k = torch.randn(KV, cap, hd, generator=g).half().to(DEVICE)
    past_v = torch.randn(KV, cap, hd, generator=g).half().to(DEVICE)
    qkv = torch.randn((H + 2 * KV) * hd, generator=g).to(DEVICE)
    cos, sin = (torch.rand(cap, hd, generator=g).to(DEVICE), torch.rand(cap, hd, generator=g).to(DEVICE)) if rope else (None, None)
    q_norm, k_norm = ((torch.rand(hd, generator=g) + 0.5).to(DEVICE), (torch.rand(hd, generator=g) + 0.5).to(DEVICE)) \
        if qk_norm else (None, None)
    pos = torch.tensor([33], device=DEVICE)
    results = []
    for ops in (tri, ref):
        k, v = past_k.clone(), past_v.clone()
        q, out = torch.zeros(H * hd, device=DEVICE), torch.zeros(H * hd, device=DEVICE)
        ops.rope_kv(qkv, q, k, v, cos, sin, pos, H, KV, hd, q_norm=q_norm, k_norm=k_norm, eps=1e-6)
        ops.attention(q, k, v, out, pos, 0.25, H, KV, hd, window=window)
        results.append((q, k, v, out))
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=2e-3)
    # the reference by hand: head 0 (kv head 0) over the visible rows
    q0, k_rows, v_rows = results[1][0][:hd], results[1][1][0].float(), results[1][2][0].float()
    if qk_norm and not rope:  # the norm alone, by hand
        raw = qkv[:hd]
        torch.testing.assert_close(q0, raw * torch.rsqrt(raw.pow(2).mean() + 1e-6) * q_norm, rtol=1e-5, atol=1e-5)
    first = max(0, 34 - window) if window else 0
    probs = torch.softmax(k_rows[first:34] @ q0 * 0.25, dim=0)
    torch.testing.assert_close(results[0][3][:hd], probs @ v_rows[first:34], rtol=2e-3, atol=2e-3)
    # the cache rows past pos are untouched, row pos holds the new k
    assert torch.equal(results[0][1][:, 34:], past_k[:, 34:])
    assert not torch.equal(results[0][1][:, 33], past_k[:, 33])


@pytest.mark.parametrize("fmt", FORMATS)
def test_embed_row_and_add_and_norm(fmt):
    tri, ref = _both()
    table = _mat(50, 96, fmt, 6)
    token = torch.tensor([17], device=DEVICE)
    outs = []
    for ops in (tri, ref):
        x = torch.zeros(96, device=DEVICE)
        ops.embed(token, table, x, 1.5)
        y = torch.ones(96, device=DEVICE)
        ops.add(x, y)
        z = torch.zeros(96, device=DEVICE)
        ops.rmsnorm(x, torch.full((96,), 2.0, device=DEVICE), z, 1e-6)
        r = torch.ones(96, device=DEVICE)
        ops.rmsnorm(x, torch.full((96,), 2.0, device=DEVICE), r, 1e-6, add=True)  # r = 1 + z
        outs.append((x, z, r))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[1][0], table.dequantize()[17] * 1.5 + 1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][2], outs[0][1] + 1, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU tier through Triton's interpreter (CUDA: "
                    "bench.gpu_kernels_ab compares the tokens)")
@pytest.mark.parametrize("tier_format,weight_format", [("q4_1", "int4"), ("q8", "int8")])
def test_whole_program_on_word_reads_equals_the_torch_ops(tiny_model_dir, tier_format, weight_format):
    """A tiny Llama's decode program (attention, hot rows beside cold rows on the host, output layer and embeddings
    on the tier) through the Triton kernels with every quantized matrix read as words gives the torch ops' logits."""
    from helpers_plans import tier_units_model
    from online.gpu.graph_step import GpuDecodeStep
    from online.gpu.ops import MatvecLaunch, MatvecTLaunch
    from tandem.core.kv_cache import KVCache
    folder, _ = tiny_model_dir("llama")
    model, executor, _ = tier_units_model(folder, (True, True), head=True, embeddings=True, weight_format=weight_format,
                                          tier_format=tier_format, hot_format=tier_format)
    assert {executor.splits[0].gpu.up.fmt, executor.splits[0].gpu.down_t.fmt} == {tier_format}
    logits = {}
    for backend in ("torch", "triton"):
        step = GpuDecodeStep.build(model, executor, capture=False, backend=backend)
        ops = step.layers.ctx.ops
        ops.matvec_launch = lambda r, c: MatvecLaunch(32, 64, 2, words=True)  # (few programs: the interpreter's pace)
        ops.matvec_t_launch = lambda r, c: MatvecTLaunch(32, 16, 64, 2, words=True)
        cache = KVCache(model.cfg, 16)
        with torch.inference_mode():
            logits[backend] = torch.stack([step(t, pos, cache) for pos, t in enumerate([5, 17, 42])])
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-3, atol=1e-3)
