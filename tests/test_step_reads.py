"""The cost model's bytes per packed format (placement.step_reads, online.step_inventory) against the packed
tensors themselves and ggml's block sizes; the per-format probe's output and the calibration file's schema."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from online.kernels.quantize import quantize, weight_from_gguf
from placement.fused_calibration import FusedCalibration, FusedTerms, KindRate, load_calibration, save_calibration
from placement.predictor_info import LayerPredictorInfo, PredictorInfo
from placement.step_reads import LayerFractions, StepUnit, bytes_by_kind, layer_fractions, modeled_reads
from tandem.core.errors import TandemError

QTYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K"]
pytestmark = pytest.mark.usefixtures("small_eviction")  # the probe passes here are tiny (tests/conftest.py)
D, N_FF, VOCAB = 256, 512, 64


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=N_FF, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("wide-llama-reads")
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


def _ggml_bytes(qtype: str, rows: int, cols: int) -> int:
    per, nbytes = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, qtype)]
    return rows * cols // per * nbytes


@pytest.mark.parametrize("qtype", QTYPES)
def test_step_bytes_per_format_equal_the_packed_tensors(wide_llama, qtype):
    from online.execution.fused_decode import FusedDecodeStep
    from online.execution.quantized_linear import QuantizedLinearModule
    from online.kernels.ffn import QuantizedFFN, QuantizedLinear
    from online.kind_probe import random_gguf
    from online.step_inventory import step_units
    from test_fused_decode import packed

    model, executor = packed(wide_llama, "int8", thresholds=[0.02])
    rng = np.random.default_rng(3)

    def blocks(rows: int, cols: int):
        return weight_from_gguf(random_gguf(qtype, rows, cols, rng), qtype, (rows, cols))

    attn = model.layers[0].self_attn
    weights = {"qkv": blocks(512, D), "o": blocks(D, D), "up": blocks(N_FF, D), "gate": blocks(N_FF, D),
               "head": blocks(VOCAB, D)}
    attn.qkv_proj = QuantizedLinearModule(QuantizedLinear(weights["qkv"]))  # q 256 + k 128 + v 128
    attn.o_proj = QuantizedLinearModule(QuantizedLinear(weights["o"]))
    down_t = quantize(np.random.default_rng(4).standard_normal((N_FF, D)).astype(np.float32), "fp16")
    executor.splits[0].cpu = QuantizedFFN(up=weights["up"], down_t=down_t, gate=weights["gate"], act="silu", threads=2)
    executor.head = QuantizedLinear(weights["head"])
    units = step_units(FusedDecodeStep.build(model, executor), model.cfg)

    by_kind = bytes_by_kind(units)
    name = qtype.lower()
    assert by_kind[name] == sum(w.nbytes for w in weights.values())  # the packed arrays' own bytes
    assert by_kind[name] == sum(_ggml_bytes(qtype, *w.shape) for w in weights.values())  # ggml's block sizes
    assert by_kind["f16"] == down_t.w.nbytes == N_FF * D * 2
    assert by_kind["f32"] == 4 * D  # one embedding row
    assert set(by_kind) == {name, "f16", "f32"}
    assert {u.role for u in units} == {"qkv", "o", "gate", "up", "down_t", "head", "embed_row"}
    want_rows = {**{k: w.shape[0] for k, w in weights.items()}, "down_t": N_FF, "embed_row": 1}
    assert {u.role: u.rows for u in units} == want_rows

    # the dense GGUF down of non-ReLU layers: the same blocks, read dense in place
    down = blocks(D, N_FF)
    executor.splits[0].cpu = QuantizedFFN(up=weights["up"], down_t=None, gate=weights["gate"], down=down, act="silu")
    units = step_units(FusedDecodeStep.build(model, executor), model.cfg)
    assert bytes_by_kind(units)[name] == sum(w.nbytes for w in weights.values()) + down.nbytes
    assert [u for u in units if u.role == "down"][0].packed_bytes == _ggml_bytes(qtype, D, N_FF)


def test_modeled_reads_follow_the_row_fractions():
    units = [StepUnit("qkv", 0, "q8_0", 1000), StepUnit("gate", 0, "q4_0", 400), StepUnit("up", 0, "q4_0", 400),
             StepUnit("down_t", 0, "f16", 800), StepUnit("head", -1, "q8_0", 5000), StepUnit("embed_row", -1, "f32", 16)]
    exact = [LayerFractions(gate=1.0, up=0.25, down=0.25)]
    assert modeled_reads(units, exact, relu=True) == {
        ("q8_0", "dense"): 6000, ("q4_0", "dense"): 400, ("q4_0", "gather"): 100, ("f16", "axpy"): 200, ("f32", "dense"): 16}
    # a non-ReLU exact layer reads up in full, with its gate in one slice loop; a predictor layer gathers gate and up
    assert modeled_reads(units, exact, relu=False)[("q4_0", "dense_gu")] == 800
    predicted = [LayerFractions(gate=0.5, up=0.25, down=0.25, predicted=True)]
    reads = modeled_reads(units, predicted, relu=True)
    assert reads[("q4_0", "gather")] == 400 * 0.5 + 400 * 0.25 and ("q4_0", "dense") not in reads
    assert modeled_reads(units, None, relu=True)[("f16", "axpy")] == 800  # every row


def test_a_paired_gate_and_up_are_one_pass_of_neighbouring_rows():
    """A predictor layer with a paired gate / up copy reads each predicted neuron's two rows together: both at
    the predicted share (the up row is not cut by the gate), priced as ``pair`` (a calibration without that
    rate: the gathered one), one pass for the two; without a predictor the layer's own matrices are read."""
    from placement.step_reads import modeled_passes, read_fractions

    units = [StepUnit("qkv", 0, "q8_0", 1000), StepUnit("gate", 0, "q4_0", 400, in_place=True, paired=True),
             StepUnit("up", 0, "q4_0", 400, in_place=True, paired=True), StepUnit("down_t", 0, "f16", 800),
             StepUnit("pred", 0, "int8", 50)]
    predicted = [LayerFractions(gate=0.5, up=0.25, down=0.25, predicted=True)]
    assert modeled_reads(units, predicted, relu=True) == {("q8_0", "dense"): 1000, ("q4_0", "pair"): 400,
                                                          ("f16", "axpy"): 200, ("int8", "dense"): 50}
    assert read_fractions(units, predicted, relu=True)[("q4_0", "pair")] == 0.5
    apart = [StepUnit(u.role, u.layer, u.kind, u.packed_bytes, u.in_place) for u in units]
    assert modeled_passes(units, predicted, relu=True) == modeled_passes(apart, predicted, relu=True) - 1 == 4
    exact = [LayerFractions(gate=1.0, up=0.25, down=0.25)]  # no predictor: the gate cut over the layer's own rows
    assert modeled_reads(units, exact, relu=True) == modeled_reads(apart, exact, relu=True)
    reads = {("q4_0", "pair"): 1e6}
    gathered = _cal((KindRate("q4_0", "gather", 0.2),))
    assert gathered.reads_seconds(0, reads, fixed=False) == pytest.approx(1e6 / 2e9)
    both = _cal((KindRate("q4_0", "gather", 0.2), KindRate("q4_0", "pair", 0.25)))
    assert both.reads_seconds(0, reads, fixed=False) == pytest.approx(1e6 / 2.5e9)


def test_a_gate_and_up_read_whole_are_one_pass_of_two_streams():
    """A gated layer that reads its gate and up in full (no predictor, no gate cut) reads them in one slice loop:
    ``dense_gu`` (``rows_gu`` in place), one pass; priced at its own rate, else at the single-matrix one."""
    from placement.step_reads import modeled_passes

    units = [StepUnit("gate", 0, "q4_1", 400), StepUnit("up", 0, "q4_1", 400), StepUnit("down_t", 0, "f16", 800),
             StepUnit("gate", 1, "q4_0", 400, in_place=True), StepUnit("up", 1, "q4_0", 400, in_place=True),
             StepUnit("down_t", 1, "f16", 800)]
    whole = [LayerFractions(1.0, 1.0, 0.5)] * 2
    assert modeled_reads(units, whole, relu=False) == {("q4_1", "dense_gu"): 800, ("q4_0", "rows_gu"): 800,
                                                        ("f16", "axpy"): 800}
    assert modeled_passes(units, whole, relu=False) == 4
    cut = modeled_reads(units, [LayerFractions(1.0, 0.25, 0.25)] * 2, relu=True)  # the gate cut: gate alone, whole
    assert cut[("q4_1", "dense")] == 400 and cut[("q4_0", "rows")] == 400
    ungated = modeled_reads([u for u in units if u.role != "gate"], whole, relu=False)
    assert ungated[("q4_1", "dense")] == 400  # no gate: one matrix
    reads = {("q4_1", "dense_gu"): 1e6, ("q4_0", "rows_gu"): 1e6}
    apart = _cal((KindRate("q4_1", "dense", 0.5), KindRate("q4_0", "rows", 0.4)))
    assert apart.reads_seconds(0, reads, fixed=False) == pytest.approx(1e6 / 5e9 + 1e6 / 4e9)
    both = _cal((KindRate("q4_1", "dense", 0.5), KindRate("q4_1", "dense_gu", 0.25), KindRate("q4_0", "rows_gu", 0.2)))
    assert both.reads_seconds(0, reads, fixed=False) == pytest.approx(1e6 / 2.5e9 + 1e6 / 2e9)


def test_kv_reads_are_priced_at_the_attention_rate_of_their_group():
    """The KV cache's bytes at the ``attend`` rate interpolated over KV heads per query head; a calibration
    from before the attention pass prices them at its float32 dense rate."""
    cal = _cal((KindRate("f16", "attend", 0.4, fraction=0.25), KindRate("f16", "attend", 0.8, fraction=1.0),
                KindRate("f32", "dense", 0.3)))
    reads = {("f16", "attend"): 1e6}
    assert cal.reads_seconds(0, reads, fixed=False, fractions={("f16", "attend"): 1.0}) == pytest.approx(1e6 / 8e9)
    assert cal.reads_seconds(0, reads, fixed=False, fractions={("f16", "attend"): 0.5}) == pytest.approx(
        1e6 / ((0.4 + (0.5 - 0.25) / 0.75 * 0.4) * 10e9))
    old = _cal((KindRate("f32", "dense", 0.3),))
    assert old.reads_seconds(0, reads, fixed=False) == pytest.approx(1e6 / 3e9)
    f32_only = _cal((KindRate("f32", "attend", 0.5, fraction=1.0), KindRate("f32", "dense", 0.3)))
    assert f32_only.reads_seconds(0, reads, fixed=False) == pytest.approx(1e6 / 5e9)  # the other type's attention


def test_layer_fractions_count_the_rows_read():
    freq = np.array([[1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # 2 of 8 neurons always fire, the rest never
    relu, = layer_fractions("relu", freq)
    assert (relu.gate, relu.up, relu.down, relu.predicted) == (1.0, 0.25, 0.25, False)
    silu, = layer_fractions("threshold", freq)
    assert (silu.gate, silu.up, silu.down) == (1.0, 1.0, 0.25)
    # a predictor marking the 2 active neurons (recall 1) and 1 of the 6 silent ones: 3 of 8 gate rows
    info = PredictorInfo((LayerPredictorInfo(True, 100, recall=1.0, predicted_active_fraction=3 / 8),), "p")
    pred, = layer_fractions("relu", freq, info)
    assert pred.predicted and pred.gate == pytest.approx(3 / 8) and pred.up == pred.down == pytest.approx(2 / 8)


def _cal(rates) -> FusedCalibration:
    return FusedCalibration(threads=2, read_bandwidth_bytes_per_s=10e9, terms=(FusedTerms("int4", 1e-4, 1e-5, 1.0),),
                            rates=rates)


def test_calibration_rates_model_and_schema(tmp_path):
    cal = _cal((KindRate("q8_0", "dense", 0.5, 10, 1e-3), KindRate("q8_0", "axpy", 0.25)))
    reads = {("q8_0", "dense"): 5e6, ("q8_0", "gather"): 1e6, ("q8_0", "axpy"): 1e6}
    want = 1e-4 + 3 * 1e-5 + 5e6 / 5e9 + 1e6 / 5e9 + 1e6 / 2.5e9  # gather: no rate, the dense one stands in
    assert cal.reads_seconds(3, reads) == pytest.approx(want)
    with pytest.raises(TandemError, match="no fused-step rate for q6_k"):
        cal.reads_seconds(3, {("q6_k", "dense"): 1.0})
    path = save_calibration(cal, tmp_path / "cal.json")
    assert load_calibration(path) == cal
    data = json.loads(path.read_text())
    assert set(data["rates"][0]) == {"kind", "access", "share", "bytes", "seconds", "fraction", "row_s", "row_bytes"}
    del data["rates"]  # files from before the per-format rates still load
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_calibration(tmp_path / "old.json").rates == ()
    for bad in ([{"kind": "q8_0", "access": "sideways", "share": 0.5}], [{"kind": "q8_0", "access": "dense", "share": 0}],
                [{"kind": "q8_0", "access": "dense", "share": 0.5, "extra": 1}], ["q8_0"],
                [{"kind": "q8_0", "access": "axpy", "share": 0.5, "fraction": 0}],
                [{"kind": "q8_0", "access": "dense", "share": 0.5, "row_s": 1e-9}],  # a row cost needs its row length
                [{"kind": "q8_0", "access": "dense", "share": 0.5, "row_s": -1e-9, "row_bytes": 100}]):
        (tmp_path / "bad.json").write_text(json.dumps({**data, "rates": bad}))
        with pytest.raises(TandemError, match="invalid fused-step"):
            load_calibration(tmp_path / "bad.json")


def test_probe_rates_schema(monkeypatch):
    from online import kind_probe

    monkeypatch.setattr(kind_probe, "PROBE_BYTES", 256 * 1024)
    monkeypatch.setattr(kind_probe, "REPEATS", 2)
    kind_probe.cached_weight.cache_clear()
    try:
        plan = kind_probe.plan_for([("q4_1", "dense"), ("q4_1", "rows"), ("q6_k", "gather"), ("q8_0", "axpy"),
                                    ("f16", "axpy"), ("q4_1", "pair")])
        assert plan == (("Q4_1", "dense"), ("Q4_1", "rows"), ("Q6_K", "gather"), ("int8b", "axpy"), ("fp16", "axpy"),
                        ("Q4_1", "pair"))
        rates = kind_probe.measure_kind_rates(2, 10e9, plan)
    finally:
        kind_probe.cached_weight.cache_clear()
    sparse = kind_probe.SPARSE_SHARES
    assert [(r.kind, r.access, r.fraction) for r in rates] == [("q4_1", "dense", 1.0), ("q4_1", "rows", 1.0)] + [
        (k, a, f) for k, a in (("q4_1", "pair"), ("q6_k", "gather"), ("q8_0", "axpy"), ("f16", "axpy")) for f in sparse]
    rows = 256 * 1024 // (kind_probe.COLS // 32 * 20)
    assert rates[0].bytes == rates[1].bytes == _ggml_bytes("Q4_1", rows, kind_probe.COLS)  # every row read once
    pair_rows = [2 * max(1, int(rows // 2 * f)) for f in sparse]  # both rows of a share of the neurons
    assert [r.bytes for r in rates[2:5]] == [_ggml_bytes("Q4_1", n, kind_probe.COLS) for n in pair_rows]
    f16_rows = int(256 * 1024 // (2 * kind_probe.COLS))
    assert [r.bytes for r in rates[-3:]] == [max(1, int(f16_rows * f)) * 2 * kind_probe.COLS for f in sparse]
    assert all(r.share > 0 and r.seconds > 0 and np.isfinite(r.share) for r in rates)
    kind_probe.cached_weight.cache_clear()
    try:  # a gate and up read whole together: the matrix's first 2n rows (n: whole groups of 64), once each
        gu = kind_probe.measure_kind_rates(2, 10e9, kind_probe.plan_for([("q4_1", "dense_gu"), ("q4_0", "rows_gu")]))
    finally:
        kind_probe.cached_weight.cache_clear()
    assert [(r.kind, r.access, r.fraction) for r in gu] == [("q4_1", "dense_gu", 1.0), ("q4_0", "rows_gu", 1.0)]
    assert gu[0].bytes == _ggml_bytes("Q4_1", rows // 2 // 64 * 64 * 2, kind_probe.COLS)
    with pytest.raises(TandemError, match="cannot time"):
        kind_probe.plan_for([("q2_k", "dense")])


def test_matrices_kept_in_place_are_priced_as_rows_not_as_the_interleaved_copy(monkeypatch):
    """The step interleaves Q4_0 / Q4_1 / Q8_0 matrices eight rows at a time for dense reads, but keeps the
    gate / up of predictor and ReLU layers row by row for gathered reads; read whole (the gate cut, a dense
    mode) those are the ``rows`` access, with a rate of their own (a calibration without it: the dense one)."""
    from online import kind_probe
    from online.kernels.native import load_native
    from online.kernels.native.structs import interleave
    from online.step_inventory import _unit
    from placement.step_reads import modeled_reads

    monkeypatch.setattr(kind_probe, "PROBE_BYTES", 256 * 1024)
    kind_probe.cached_weight.cache_clear()
    try:
        ref = kind_probe.cached_weight("Q4_0", False)[1]
        in_place, copy = _unit("gate", 0, ref.desc), _unit("qkv", 0, interleave(ref, load_native().lib).desc)
    finally:
        kind_probe.cached_weight.cache_clear()
    assert (in_place.kind, in_place.in_place, copy.kind, copy.in_place) == ("q4_0", True, "q4_0", False)
    assert in_place.packed_bytes == copy.packed_bytes  # the same bytes in either layout
    units = [StepUnit("qkv", 0, "q4_0", 1000), StepUnit("gate", 0, "q4_0", 400, in_place=True),
             StepUnit("up", 0, "q4_0", 400, in_place=True), StepUnit("down_t", 0, "f16", 800)]
    assert modeled_reads(units, None, relu=True) == {("q4_0", "dense"): 1000, ("q4_0", "rows_gu"): 800, ("f16", "axpy"): 800}
    exact = modeled_reads(units, [LayerFractions(1.0, 0.25, 0.25)], relu=True)  # the gate cut: gate whole, up gathered
    assert exact == {("q4_0", "dense"): 1000, ("q4_0", "rows"): 400, ("q4_0", "gather"): 100, ("f16", "axpy"): 200}
    ungated = modeled_reads([u for u in units if u.role != "gate"], [LayerFractions(1.0, 0.25, 0.25)], relu=True)
    assert ungated == {("q4_0", "dense"): 1000, ("q4_0", "rows"): 400, ("f16", "axpy"): 200}  # OPT: no gate cut, every up row
    predicted = modeled_reads(units, [LayerFractions(0.25, 0.25, 0.25, True)], relu=True)
    assert ("q4_0", "rows") not in predicted and predicted[("q4_0", "gather")] == 200
    with_rows = _cal((KindRate("q4_0", "dense", 1.0), KindRate("q4_0", "rows", 0.5)))
    without = _cal((KindRate("q4_0", "dense", 1.0),))
    reads = modeled_reads(units[:3], None, relu=True)
    assert with_rows.reads_seconds(0, reads, fixed=False) == pytest.approx((1000 + 800 / 0.5) / 10e9)
    assert without.reads_seconds(0, reads, fixed=False) == pytest.approx(1800 / 10e9)


def test_rates_interpolate_over_the_row_fraction():
    cal = _cal((KindRate("f16", "axpy", 0.2, fraction=0.1), KindRate("f16", "axpy", 0.6, fraction=0.5),
                KindRate("f16", "axpy", 1.0, fraction=1.0)))
    assert cal.rate("f16", "axpy", 0.3).share == pytest.approx(0.4)
    assert cal.rate("f16", "axpy", 0.05).share == 0.2 and cal.rate("f16", "axpy", None).share == 1.0
    reads = {("f16", "axpy"): 3e6}
    assert cal.reads_seconds(0, reads, fixed=False, fractions={("f16", "axpy"): 0.75}) == pytest.approx(3e6 / (0.8 * 10e9))
    # the byte-weighted row share per (format, access)
    units = [StepUnit("down_t", 0, "f16", 1000), StepUnit("down_t", 1, "f16", 3000)]
    layers = [LayerFractions(1.0, 1.0, 0.5), LayerFractions(1.0, 1.0, 0.1)]
    from placement.step_reads import read_fractions
    assert read_fractions(units, layers, relu=False) == {("f16", "axpy"): pytest.approx((500 * 0.5 + 300 * 0.1) / 800)}


def test_best_of_keeps_each_rate_at_its_fastest_round():
    from placement.fused_calibration import best_of

    slow = FusedCalibration(2, 10e9, (FusedTerms("int4", 3e-5, 4e-6, 0.5),), rates=(KindRate("q4_0", "dense", 0.5),
                                                                                   KindRate("f16", "axpy", 0.4)))
    fast = FusedCalibration(2, 20e9, (FusedTerms("int4", 5e-5, 1e-6, 0.9),), rates=(KindRate("q4_0", "dense", 0.2),
                                                                                   KindRate("f16", "axpy", 0.3)))
    best = best_of([slow, fast])
    assert best.read_bandwidth_bytes_per_s == 20e9
    # q4_0 dense: 5 GB/s (slow round) vs 4 GB/s; f16 axpy: 4 vs 6 GB/s -- shares of the best bandwidth
    assert best.rate("q4_0", "dense").share == pytest.approx(5e9 / 20e9)
    assert best.rate("f16", "axpy").share == pytest.approx(6e9 / 20e9)
    t = best.term("int4")
    assert (t.call_s, t.layer_s) == (3e-5, 1e-6)
    with pytest.raises(TandemError, match="at least one"):
        best_of([])


def test_matrix_passes_are_counted_and_priced(tmp_path):
    from placement.fused_calibration import best_of
    from placement.step_reads import modeled_passes

    units = [StepUnit("qkv", 0, "q4_1", 100), StepUnit("o", 0, "q4_1", 50), StepUnit("gate", 0, "q4_1", 80),
             StepUnit("up", 0, "q4_1", 80), StepUnit("down_t", 0, "f16", 160), StepUnit("pred", 0, "q8_0", 10),
             StepUnit("head", -1, "q8_0", 300), StepUnit("embed_row", -1, "f32", 4)]
    assert modeled_passes(units, None, relu=False) == 5  # every matrix but the predictor (gate + up: one slice loop)
    predicted = [LayerFractions(0.2, 0.1, 0.1, predicted=True)]
    assert modeled_passes(units, predicted, relu=True) == 7  # the predictor's pass too
    assert modeled_passes(units, [LayerFractions(1.0, 0.0, 0.0)], relu=True) == 4  # no up or down row read: no pass
    cal = FusedCalibration(2, 10e9, (FusedTerms("int4", 1e-4, 1e-5, 1.0),), rates=(KindRate("q4_1", "dense", 0.5),),
                           pass_s=2e-6)
    reads = {("q4_1", "dense"): 5e6}
    assert cal.reads_seconds(3, reads, passes=7) == pytest.approx(1e-4 + 3e-5 + 7 * 2e-6 + 5e6 / 5e9)
    assert cal.reads_seconds(3, reads, fixed=False, passes=7) == pytest.approx(5e6 / 5e9)  # a fixed cost
    path = save_calibration(cal, tmp_path / "cal.json")
    assert load_calibration(path) == cal
    data = json.loads(path.read_text())
    del data["pass_s"]  # files from before the pass cost load with none
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_calibration(tmp_path / "old.json").pass_s == 0.0
    for bad in (-1e-6, 2.0, "fast"):
        (tmp_path / "bad.json").write_text(json.dumps({**data, "pass_s": bad}))
        with pytest.raises(TandemError, match="invalid fused-step calibration"):
            load_calibration(tmp_path / "bad.json")
    other = FusedCalibration(2, 10e9, (FusedTerms("int4", 1e-4, 1e-5, 1.0),), pass_s=3e-6)
    assert best_of([cal, other]).pass_s == 2e-6  # contention only adds to a fixed cost


def test_read_passes_compute_the_step_rows_pass_by_pass(monkeypatch):
    """tdm_read_passes (the pass-cost probe's kernel entry) reads each pass's rows as dot_rows does."""
    import ctypes

    from online import kind_probe
    from online.kernels.native import load_native
    from online.kernels.native.structs import describe, interleave

    lib = load_native().lib
    rng = np.random.default_rng(3)
    rows, cols, pass_rows, threads = 100, 96, 48, 2  # passes of 48, 48 and 4 rows
    w = weight_from_gguf(gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                              gguf.GGMLQuantizationType.Q4_1), "Q4_1", (rows, cols))
    ref = interleave(describe(w), lib)
    x = rng.standard_normal(cols).astype(np.float32)
    want = np.zeros(rows, np.float32)
    lib.tdm_dot_rows(ctypes.byref(ref.desc), 0, rows, x.ctypes.data, ctypes.c_double(2.0), want.ctypes.data)
    fn = lib.tdm_read_passes
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64]
    split = lib.tdm_row_chunk  # the probe's split of a matrix's rows between threads
    split.argtypes, split.restype = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p], None
    bounds = np.zeros(2, np.int64)
    for n_passes in (1, 2, 3):  # each call leaves its last pass's rows in out (thread t: its share of that pass)
        out = np.full((threads, rows), np.nan, np.float32)
        fn(ctypes.addressof(ref.desc), pass_rows, n_passes, x.ctypes.data, threads, out.ctypes.data, rows)
        r0 = (n_passes - 1) * pass_rows
        n = min(pass_rows, rows - r0)
        shares = []
        for t in range(threads):
            split(n, t, threads, bounds.ctypes.data)
            shares.append(out[t, :bounds[1] - bounds[0]])
        got = np.concatenate(shares)
        assert np.array_equal(got, want[r0:r0 + n]), n_passes
    monkeypatch.setattr(kind_probe, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(kind_probe, "PASS_PAIRS", 2)
    kind_probe.cached_weight.cache_clear()
    try:
        cost = kind_probe.measure_pass_cost(threads, pass_bytes=1 << 17)
    finally:
        kind_probe.cached_weight.cache_clear()
    assert 0.0 <= cost < 1e-3 and np.isfinite(cost)
    with pytest.raises(TandemError, match="threads"):
        kind_probe.measure_pass_cost(0)

def test_timed_read_pass_reads_the_rows_and_times_only_its_region():
    """tdm_read_pass_timed (the per-format probe's kernel entry) computes each thread's share of the rows as the
    row kernels do (dot_rows, dot_rows_idx, axpy_rows) and returns seconds inside the call's wall time."""
    import ctypes
    import time

    from online import kind_probe
    from online.kernels.native import load_native
    from online.kernels.native.structs import describe

    lib = load_native().lib
    rng = np.random.default_rng(5)
    rows, cols, threads = 100, 96, 2
    w = weight_from_gguf(gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                              gguf.GGMLQuantizationType.Q4_0), "Q4_0", (rows, cols))
    ref, down = describe(w), describe(quantize(rng.standard_normal((rows, cols)).astype(np.float32), "fp16"), dot_input=False)
    x, h = rng.standard_normal(cols).astype(np.float32), rng.standard_normal(rows).astype(np.float32)
    fn, timed = kind_probe._read_pass(lib)
    assert timed
    picks = np.sort(rng.choice(rows, 37, replace=False)).astype(np.int32)
    want = np.zeros(rows, np.float32)
    lib.tdm_dot_rows_idx(ctypes.byref(ref.desc), picks.ctypes.data, len(picks), x.ctypes.data, ctypes.c_double(2.0),
                         want.ctypes.data)
    out = np.full((threads, rows), np.nan, np.float32)
    t0 = time.perf_counter()
    seconds = fn(ctypes.addressof(ref.desc), 1, picks.ctypes.data, len(picks), x.ctypes.data, h.ctypes.data, threads,
                 out.ctypes.data, rows)
    wall = time.perf_counter() - t0
    assert 0.0 < seconds <= wall
    half = len(picks) // 2  # thread t: picks [n t / T, n (t + 1) / T)
    assert np.array_equal(np.concatenate([out[0, :half], out[1, :len(picks) - half]]), want[:len(picks)])
    summed = np.zeros(cols, np.float32)
    lib.tdm_axpy_rows(ctypes.byref(down.desc), picks.ctypes.data, h.ctypes.data, len(picks), summed.ctypes.data)
    out = np.zeros((threads, rows), np.float32)
    assert fn(ctypes.addressof(down.desc), 2, picks.ctypes.data, len(picks), x.ctypes.data, h.ctypes.data, threads,
              out.ctypes.data, rows) > 0.0
    np.testing.assert_allclose(out[:, :cols].sum(0), summed, rtol=1e-5, atol=1e-5)  # two partial sums
    # access 3: the first n rows (up) and the next n (gate) read together, each thread its run of 32-row slices
    n, full = 48, np.zeros(rows, np.float32)
    lib.tdm_dot_rows(ctypes.byref(ref.desc), 0, rows, x.ctypes.data, ctypes.c_double(2.0), full.ctypes.data)
    out = np.full((threads, rows), np.nan, np.float32)
    start = np.zeros(1, np.int32)
    assert fn(ctypes.addressof(ref.desc), 3, start.ctypes.data, n, x.ctypes.data, h.ctypes.data, threads,
              out.ctypes.data, rows) > 0.0
    cut = 32  # two slices of 32 rows (the second of 16): one each
    for t, (lo, hi) in enumerate(((0, cut), (cut, n))):
        assert np.array_equal(out[t, lo:hi], full[lo:hi]) and np.array_equal(out[t, n + lo:n + hi], full[n + lo:n + hi])


def test_attend_pass_computes_attention_and_the_probe_times_it(monkeypatch):
    """tdm_attend_pass_timed: every query head's softmax(q K^T / 8) V over its KV head's rows (float16 or float32
    cache) against numpy; the probe's attend rates, one per group size, with the cache's bytes."""
    from online import kind_probe
    from online.kernels.native import load_native

    lib, rng = load_native().lib, np.random.default_rng(9)
    monkeypatch.setattr(kind_probe, "PROBE_BYTES", 64 * 1024)
    monkeypatch.setattr(kind_probe, "REPEATS", 2)
    for fmt, dtype in (("fp16", np.float16), ("fp32", np.float32)):
        one = kind_probe.AttendPass(lib, fmt, 2, rng, group=3)
        assert one() > 0.0
        k, v, q = one.k.astype(np.float64), one.v.astype(np.float64), one.q.astype(np.float64)
        for h in range(q.shape[0]):
            s = k[h // 3] @ q[h] * 0.125
            p = np.exp(s - s.max())
            np.testing.assert_allclose(one.out[h], p @ v[h // 3] / p.sum(), rtol=2e-4, atol=2e-5)
        assert one.rows == kind_probe.ATTEND_CONTEXT_TOKENS and one.k.shape == (one.n_kv, one.rows, kind_probe.ATTEND_HEAD_DIM)
        assert one.nbytes == 2 * one.n_kv * one.rows * kind_probe.ATTEND_HEAD_DIM * np.dtype(dtype).itemsize
    rates = kind_probe.measure_kind_rates(2, 10e9, kind_probe.plan_for([("f16", "attend")]))
    assert [(r.kind, r.access, r.fraction) for r in rates] == [("f16", "attend", 1 / g) for g in kind_probe.ATTEND_GROUPS]
    assert all(r.share > 0 and r.bytes > 0 for r in rates)



@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("windows", [(), (4, 0)])  # every layer global; a windowed layer beside a global one
def test_kv_reads_are_the_cache_rows_attention_streams(wide_llama, windows, kv_type):
    """kv_read_bytes against the KV cache's own tensors (float16 or float32): the keys and values of positions
    [0, n) of every layer, a windowed layer's last ``window`` of them; priced as the attention kernel's reads
    at the model's KV heads per query head."""
    import dataclasses

    from placement.step_reads import kv_kind, kv_read_bytes, kv_reads, kv_shares, with_kv
    from tandem.core.kv_cache import KVCache
    from tandem.core.loading.hf_loader import load_hf_folder

    cfg = load_hf_folder(wide_llama).config
    cfg = dataclasses.replace(cfg, num_layers=2, layer_windows=windows)
    cache = KVCache(cfg, 32, dtype={"f16": torch.float16, "f32": torch.float32}[kv_type])
    for n in (0, 1, 3, 9):
        spans = [min(n, w) if w else n for w in (windows or (0, 0))]
        expected = sum(cache.keys[i, :, :s].nbytes + cache.values[i, :, :s].nbytes for i, s in enumerate(spans))
        assert kv_read_bytes(cfg, n, kv_type) == expected
    key = kv_kind(kv_type)
    assert key == (kv_type, "attend")
    reads = with_kv({("q4_0", "dense"): 10.0, key: 1.0}, kv_reads(cfg, 9, kv_type))
    assert reads == {("q4_0", "dense"): 10.0, key: 1.0 + kv_read_bytes(cfg, 9, kv_type)}
    assert kv_shares(cfg, kv_type) == {key: cfg.num_kv_heads / cfg.num_heads}
    with pytest.raises(TandemError):
        kv_read_bytes(cfg, -1)
    with pytest.raises(TandemError, match="unknown KV cache type"):
        kv_reads(cfg, 3, "bf16")
