"""A packed engine keeps a GGUF MoE file's experts in the file's blocks (online/experts/block_experts.py): gate / up
rows and a dense down read in place by the module path and by the fused step (moe.h), never decoded to float32
(which took 7x the file's bytes). References: gguf's own dequantizer with float math for an expert, the float
engine for the model, and the single-token fused step for the multi-token and batched steps."""
from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IDS = [5806, 16033, 16762, 34565, 7955, 43234, 35220, 27248, 13513, 6555, 43998, 35207]


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory, smollm2_path):
    """synth's tiny-moe: Q4_0 experts, 2 MoE layers, top 2 of 4 experts."""
    from synth import SynthSpec, get_shape, synthesize
    out = tmp_path_factory.mktemp("block-experts")
    return synthesize(SynthSpec(get_shape("tiny-moe"), sparsity=0.9), out / "tiny-moe", str(smollm2_path)).path


def _engine(path, **kw):
    from online import Engine
    return Engine.load(path, step_cache=False, **kw)


def _expert_bytes(raw) -> int:
    return sum(np.asarray(t.data).nbytes for name, t in raw.items() if ".mlp.experts." in name)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_experts_stay_in_the_files_blocks(moe_gguf):
    """Every MoE layer's experts are the file's bytes: the executor holds about the file's expert bytes (router
    aside), not the float32 decode (7.1x for Q4_0), and nothing decodes them."""
    from tandem.core.loading import load_checkpoint
    engine = _engine(moe_gguf, weight_format="int4", threads=1)
    ex = engine.executor
    assert sorted(ex.block_moe) == [0, 1] and engine.decode_path == "fused"
    file_bytes = _expert_bytes(load_checkpoint(moe_gguf).raw)
    assert file_bytes <= ex.ffn_nbytes <= 1.05 * file_bytes
    float_bytes = sum(e.nbytes for i in ex.float_moe for e in ex.float_moe[i].experts)
    assert float_bytes > 6 * file_bytes  # what they took before
    from online.experts.block_experts import unread_expert_bytes
    experts = sum(q.nbytes for i in ex.block_moe for q in ex.block_moe[i].experts)
    assert unread_expert_bytes(ex, engine.config) == experts // 2  # top 2 of 4 read per token
    dense = _engine(moe_gguf, threads=1)
    floats = sum(e.nbytes for w in dense.executor.layers for e in w.experts)
    assert unread_expert_bytes(dense.executor, dense.config) == floats // 2
    modules = _engine(moe_gguf, weight_format="int4", threads=1, fused_decode=False)
    stats = modules.generate(IDS[:4], max_new_tokens=2, ignore_eos=True).stats
    assert stats["ffn_sparsity"] == 0.0  # the selected experts' neurons, all computed (it read 1.0: 0 of 0 counted)


def test_a_block_expert_equals_the_dequantized_float_expert(moe_gguf):
    """The module path's expert (C row kernels, dense down over the file's blocks) against gguf's dequantizer
    and float math: within the int8 activation rounding, far inside what a wrong row or axis would give."""
    from tandem.core.loading import load_checkpoint
    engine = _engine(moe_gguf, weight_format="int4", threads=1)
    raw = load_checkpoint(moe_gguf).raw
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, engine.model.cfg.hidden_size)).astype(np.float32))
    for layer, expert in ((0, 1), (1, 3)):
        def deq(name):
            t = raw[f"model.layers.{layer}.mlp.experts.{expert}.{name}_proj.weight"]
            kind = getattr(gguf.GGMLQuantizationType, t.qtype)
            values = gguf.quants.dequantize(np.asarray(t.data), kind).reshape(t.shape)
            return torch.from_numpy(values.astype(np.float32))
        want = (torch.nn.functional.silu(x @ deq("gate").T) * (x @ deq("up").T)) @ deq("down").T  # [2, d]
        got = engine.executor.block_moe[layer].expert_forward(expert, x)
        assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_fused_and_module_paths_agree_with_the_float_model(moe_gguf, fmt):
    """Logits of every position, one token a step, through the fused step and through the modules, against the
    float engine: the same argmax, within the packed formats' rounding."""
    ref = _engine(moe_gguf, threads=1).logits(IDS)  # [T, vocab] float32 reference
    fused = _engine(moe_gguf, weight_format=fmt, threads=2).step_logits(IDS)
    modules = _engine(moe_gguf, weight_format=fmt, threads=2, fused_decode=False).step_logits(IDS)
    for got in (fused, modules):
        assert _rel(got, ref) < 3e-2
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_multi_token_and_batched_steps_equal_single_steps(moe_gguf, threads):
    """step_many and step_batch (paged KV, three sequences) give the single step's logits bit for bit with
    experts in blocks, also over scratch that another call left dirty."""
    from online.execution.fused_decode import FusedDecodeStep  # noqa: F401  (the step type under test)
    from tandem.core.kv_cache import KVCache
    engine = _engine(moe_gguf, weight_format="int4", threads=threads)
    step, cfg = engine.compiled_decode, engine.model.cfg
    single = KVCache(cfg, 32)
    want = torch.stack([step(t, i, single) for i, t in enumerate(IDS)])
    assert torch.equal(step.step_many(IDS, 0, KVCache(cfg, 32)), want)
    block_tokens, seqs = 4, [IDS[:5], IDS, IDS[:3]]
    pool_kv = KVCache(cfg, block_tokens * 12)
    pool = SimpleNamespace(keys=pool_kv.keys, values=pool_kv.values, block_tokens=block_tokens)
    tables = [np.arange(4 * s, 4 * s + 4, dtype=np.int32)[::-1].copy() for s in range(3)]
    tokens, positions, token_tables, wanted = [], [], [], []
    for s, ids in enumerate(seqs):
        for pos, tok in enumerate(ids):
            tokens.append(tok), positions.append(pos), token_tables.append(tables[s]), wanted.append(True)
    got = step.step_batch(tokens, positions, token_tables, pool, wanted)
    rows = [want[p] for ids in seqs for p in range(len(ids))]
    assert torch.equal(got, torch.stack(rows))
    again = KVCache(cfg, 32)  # the single step after the batched one: the same logits
    assert torch.equal(torch.stack([step(t, i, again) for i, t in enumerate(IDS)]), want)
    again = KVCache(cfg, 32)
    step._calls._batch_work[:] = 0x41  # scratch left dirty (another layout's buffers lie there): the step clears
    step._calls._work[:] = 0x41        # what it reads before writing (the experts' h buffers among them)
    assert torch.equal(step.step_many(IDS[:5], 0, KVCache(cfg, 32)), want[:5])
    assert torch.equal(torch.stack([step(t, i, again) for i, t in enumerate(IDS)]), want)


@pytest.fixture(scope="module")
def moe_gguf_q8(moe_gguf, tmp_path_factory):
    """The same model with Q8_0 blocks (bench/requant_gguf.py)."""
    from bench.requant_gguf import requantize
    out = tmp_path_factory.mktemp("block-experts-q8") / "tiny-moe.Q8_0.gguf"
    requantize(moe_gguf, out)
    return out


@pytest.fixture(params=["int4", "int8"])
def fmt_file(request, moe_gguf, moe_gguf_q8):
    """(weight format, the GGUF whose experts' blocks it keeps: Q4_0 for int4, Q8_0 for int8)."""
    return request.param, moe_gguf if request.param == "int4" else moe_gguf_q8


def test_cached_experts_hold_the_files_values(fmt_file):
    """An expert cache's buffers (pack_expert with the file's Q4_0 / Q8_0 blocks) read back as the file's decode, bit
    for bit: gate / up and the down projection (they were re-quantized: int4 / int8 codes again, a per-row int8
    down)."""
    from online.experts.packing import _dequantize, expert_blocks, pack_expert
    from tandem.core.loading import load_checkpoint
    from tandem.core.model.build import build_model
    fmt, path = fmt_file
    ckpt = load_checkpoint(path)
    _, ffn_layers = build_model(ckpt)
    for layer, expert in ((0, 1), (1, 3)):
        w = ffn_layers[layer].experts[expert]
        packed = pack_expert(ckpt.config, w, fmt, blocks=expert_blocks(ckpt.raw, layer, expert, fmt))
        views = packed.layout.views(packed.host)
        for name in ("up", "gate", "down"):
            assert torch.equal(_dequantize(views, name, 32), getattr(w, name).float()), name


@pytest.mark.parametrize("slots", [0, 2, 4])
@pytest.mark.parametrize("kept", [True, False])
def test_expert_slots_keep_the_numbers(fmt_file, slots, kept, moe_gguf, moe_gguf_q8):
    """--expert-slots changes where experts run, not what they compute: the same logits as the engine without a
    cache (float rounding), through the module path (cache hits on the tier, misses on the CPU) and the fused step;
    also where the format does not keep the file's blocks (int4 on Q8_0, int8 on Q4_0: both quantize alike)."""
    fmt, path = fmt_file
    if not kept:
        path = moe_gguf_q8 if fmt == "int4" else moe_gguf
    ref = _engine(path, weight_format=fmt, threads=1, fused_decode=False).logits(IDS)  # [T, vocab]
    ours = _engine(path, weight_format=fmt, threads=1, fused_decode=False, expert_slots=slots,
                   gpu_device="cpu").logits(IDS)
    assert _rel(ours, ref) < 1e-5 and torch.equal(ours.argmax(-1), ref.argmax(-1))
    cached = _engine(path, weight_format=fmt, threads=1, expert_slots=slots, gpu_device="cpu")
    assert cached.decode_path == ("fused" if slots == 0 else "modules")  # slots: the cache decides per token
    steps = cached.step_logits(IDS)  # token by token: hits on the tier in float, misses through the C rows
    want = _engine(path, weight_format=fmt, threads=1, fused_decode=slots == 0).step_logits(IDS)
    assert _rel(steps, want) < (1e-5 if slots == 0 else 2e-2) and torch.equal(steps.argmax(-1), want.argmax(-1))


def test_plans_count_the_experts_as_the_runtime_keeps_them(fmt_file, tmp_path_factory):
    """A plan made for the file's formats names its experts' blocks (the ``experts`` role) and counts each cache slot
    as the runtime packs it: the tier holds, by kind, what plan.json says, at 10 / 50 / 100% of the model's bytes.
    A plan without the role (made before it) still loads, its experts quantized as it counted them."""
    from helpers_plans import tiny_plan
    from placement.plan import read_plan
    from placement.settings import checkpoint_tensor_formats
    from tandem.core.loading import load_checkpoint
    from test_gpu_plan import PLACED_KINDS
    fmt, path = fmt_file
    formats = checkpoint_tensor_formats(load_checkpoint(path))
    assert formats["experts"] == {"int4": "q4", "int8": "q8"}[fmt]  # gate, up and down all Q4_0 / Q8_0
    out = tmp_path_factory.mktemp("moe-plans")
    for fraction in (0.1, 0.5, 1.0):
        plan_dir = tiny_plan(path, out, "rtx4090", fraction, weight_format=fmt, tensor_formats=formats)
        plan = read_plan(plan_dir)
        engine = _engine(path, plan=plan_dir, gpu_device="cpu", fused_decode=False, threads=1)
        runtime = engine.executor.tier.bytes_by_kind()
        for key in PLACED_KINDS:
            assert runtime.get(key, 0) == plan.gpu_bytes_by_kind[key], (fraction, key, runtime, plan.gpu_bytes_by_kind)
        fields = {f.name: f for f in engine.executor.experts.packed[0][0].layout.fields}
        assert {"down.packed", "down.q"} & set(fields)  # the file's blocks, their f16 scales as stored
        assert fields["up.scale" if fmt == "int4" else "up.bscale"].dtype == torch.float16
        assert engine.executor.block_moe == {}  # the runtime packs the experts, once
        assert engine.executor.settings.weight_format == fmt  # the file's kind (was int8 for any MoE GGUF)
    older = {k: v for k, v in formats.items() if not k.endswith("experts")}
    plan_dir = tiny_plan(path, out / "older", "rtx4090", 0.5, weight_format=fmt, tensor_formats=older)
    engine = _engine(path, plan=plan_dir, gpu_device="cpu", fused_decode=False, threads=1)
    assert engine.executor.tier.bytes_by_kind().get("experts", 0) <= read_plan(plan_dir).gpu_bytes_by_kind["experts"]
    scale = next(f for f in engine.executor.experts.packed[0][0].layout.fields if f.name.endswith("scale"))
    assert scale.dtype == torch.float32  # quantized again (the file's blocks: f16 scales)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def float_moe_dir(tmp_path_factory, request):
    """A random transformers Mixtral / Qwen2-MoE (a shared expert) whose widths the 32-wide blocks divide."""
    import transformers as tf
    from conftest import TINY_COMMON
    torch.manual_seed(0)
    if request.param == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                                       num_experts_per_tok=2, intermediate_size=64, **TINY_COMMON))
    else:
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=96, intermediate_size=96, **TINY_COMMON))
    folder = tmp_path_factory.mktemp(f"float-{request.param}")
    model.eval().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_float_checkpoint_experts_are_packed_in_the_engines_format(float_moe_dir, fmt):
    """A float MoE checkpoint (no blocks) under --weight-format int4 / int8: experts (and a shared expert) quantized
    as its dense layers are (they stayed float32), in the same layout; the fused step and the modules agree with
    the float model."""
    from online import Engine
    folder = float_moe_dir
    ref_engine = Engine.load(str(folder), threads=1)
    ids = list(range(3, 15))
    ref = ref_engine.logits(ids)
    engine = Engine.load(str(folder), weight_format=fmt, threads=1, step_cache=False)
    ex = engine.executor
    moe_layers = sorted(ex.float_moe)
    assert moe_layers and sorted(ex.block_moe) == moe_layers and engine.decode_path == "fused"
    float_bytes = sum(ex.float_moe[i].nbytes for i in moe_layers)  # experts, shared expert, router
    held = sum(ex.block_moe[i].nbytes for i in moe_layers)
    assert all((ex.block_moe[i].shared is None) == (ex.float_moe[i].shared_expert is None) for i in moe_layers)
    assert held < {"int4": 0.2, "int8": 0.3}[fmt] * float_bytes
    fused = engine.step_logits(ids)
    modules = Engine.load(str(folder), weight_format=fmt, threads=1, fused_decode=False).step_logits(ids)
    assert _rel(fused, modules) < 3e-2  # the fused step's int8 activations
    assert _rel(modules, ref) < {"int4": 0.2, "int8": 0.02}[fmt]  # random weights at int4: ~0.13 (attention included)
    cached = Engine.load(str(folder), weight_format=fmt, threads=1, expert_slots=2, gpu_device="cpu")
    runtime = cached.executor.experts  # an expert cache packs the same experts, and a shared expert alike
    assert sorted(runtime.cpu_shared) == [i for i in moe_layers if ex.block_moe[i].shared is not None]
    plain = Engine.load(str(folder), weight_format=fmt, threads=1, fused_decode=False)
    assert _rel(cached.logits(ids), plain.logits(ids)) < 2e-2  # hits in float on the tier, the rest in C rows
    assert cached.decode_path == "modules" and _rel(cached.step_logits(ids), modules) < 2e-2
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for i in moe_layers:  # each layer against its float experts: the formats' rounding, not a wrong row or axis
        from tandem.core.ffn.dense import moe_forward
        want = moe_forward(engine.config, ex.float_moe[i], x)
        assert _rel(ex.block_moe[i].forward(x), want) < {"int4": 0.2, "int8": 0.03}[fmt]  # measured 0.12-0.15, 0.01


def test_the_experts_role_marks_each_layer_whose_blocks_are_kept():
    """checkpoint_tensor_formats' ``experts``: the kept kind where gate, up and down are all Q4_0, Q4_1 or Q8_0,
    ``fp32`` for a layer whose experts are packed from float (another kind), no role where no layer keeps them."""
    from placement.settings import checkpoint_tensor_formats

    from tandem.core.tier_format import format_lookup

    def per_layer(kinds_by_layer):  # each layer's experts format (None: no role)
        types = {f"model.layers.{i}.mlp.experts.0.{p}_proj.weight": q
                 for i, (g, u, d) in enumerate(kinds_by_layer) for p, q in (("gate", g), ("up", u), ("down", d))}
        cfg = SimpleNamespace(num_layers=len(kinds_by_layer), tie_word_embeddings=False)
        pairs = checkpoint_tensor_formats(SimpleNamespace(quant_types=types, config=cfg)).items()
        return [format_lookup(pairs, "experts", i, None) for i in range(len(kinds_by_layer))]
    assert per_layer([("Q4_0",) * 3] * 3) == ["q4"] * 3
    assert per_layer([("Q4_1",) * 3] * 2) == ["q4_1"] * 2
    assert per_layer([("Q4_0", "Q4_0", "Q4_1")] * 2) == [None, None]  # kinds mixed within an expert: not kept
    assert per_layer([("Q4_0",) * 3, ("Q4_0", "Q4_0", "Q6_K"), ("Q4_0",) * 3]) == ["q4", "fp32", "q4"]
    assert per_layer([("Q8_0",) * 3, ("Q4_K",) * 3]) == ["q8", "fp32"]
    assert per_layer([("Q4_K", "Q4_K", "Q6_K")] * 2) == [None, None]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n_ff", [64, 96])
def test_a_cache_slot_is_the_files_bytes_and_the_planners_count(qtype, n_ff):
    """An expert kept in Q4_0 / Q4_1 / Q8_0 blocks takes the file's bytes (f16 scales; 64-byte aligned fields), and
    expert_layout_bytes(file_blocks=...) counts exactly that; quantized from float, the count matches too."""
    from online.experts.packing import _dequantize, pack_expert
    from tandem.core.config import ModelConfig
    from tandem.core.ffn.weights import FFNWeights
    from tandem.core.tier_format import expert_layout_bytes
    d = 64
    rng = np.random.default_rng(0)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    floats = {n: rng.standard_normal(s).astype(np.float32) for n, s in (("up", (n_ff, d)), ("gate", (n_ff, d)),
                                                                         ("down", (d, n_ff)))}
    blocks = {n: SimpleNamespace(data=gguf.quants.quantize(w, kind), qtype=qtype, shape=w.shape)
              for n, w in floats.items()}
    decoded = {n: torch.from_numpy(gguf.quants.dequantize(b.data, kind).reshape(b.shape)) for n, b in blocks.items()}
    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=d, intermediate_size=n_ff, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=16)
    w = FFNWeights(up=decoded["up"], down=decoded["down"], gate=decoded["gate"])
    fmt, role = ("int8", "q8") if qtype == "Q8_0" else ("int4", {"Q4_0": "q4", "Q4_1": "q4_1"}[qtype])
    packed = pack_expert(cfg, w, fmt, blocks=blocks)
    file_bytes = sum(b.data.nbytes for b in blocks.values())
    assert packed.nbytes == expert_layout_bytes(d, n_ff, True, fmt, file_blocks=role) < file_bytes + 64 * 9
    views = packed.layout.views(packed.host)
    assert all(torch.equal(_dequantize(views, n, 32), decoded[n]) for n in ("up", "gate", "down"))
    assert pack_expert(cfg, w, fmt).nbytes == expert_layout_bytes(d, n_ff, True, fmt)


@pytest.mark.parametrize("threads", [1, 3])
def test_q5_0_experts_read_in_place(moe_gguf, tmp_path_factory, threads):
    """Experts in Q5_0 blocks (a k-quant-style kind: GGUFBlockWeight rows and a dense down read in place), at one
    and three threads: the fused step and the modules agree with the float model; step_many = single steps."""
    from bench.requant_gguf import requantize
    from tandem.core.kv_cache import KVCache
    path = tmp_path_factory.mktemp("q5-experts") / "tiny-moe.Q5_0-experts.gguf"
    assert requantize(moe_gguf, path, "Q5_0", only="exps") == 6  # gate / up / down of 2 layers
    ref = _engine(path, threads=1).logits(IDS)
    engine = _engine(path, weight_format="int4", threads=threads)
    assert sorted(engine.executor.block_moe) == [0, 1] and engine.decode_path == "fused"
    assert engine.executor.block_moe[0].experts[0].up.qtype == "Q5_0"
    fused = engine.step_logits(IDS)
    modules = _engine(path, weight_format="int4", threads=threads, fused_decode=False).step_logits(IDS)
    for got in (fused, modules):
        assert _rel(got, ref) < 3e-2 and torch.equal(got.argmax(-1), ref.argmax(-1))
    step = engine.compiled_decode
    single = KVCache(engine.model.cfg, 32)
    want = torch.stack([step(t, i, single) for i, t in enumerate(IDS)])
    assert torch.equal(step.step_many(IDS, 0, KVCache(engine.model.cfg, 32)), want)


def test_stats_count_the_experts_each_tier_ran(moe_gguf):
    """Every token runs top_k experts in each MoE layer: on the tier (cache hits, copied misses) or the CPU. A cache
    with slots keeps the module path, which consults it (the fused step read every expert from RAM, its slots unused
    and its stats empty); without slots the fused step counts its experts on the CPU."""
    per_token = 2 * 2  # 2 MoE layers x top 2
    cached = _engine(moe_gguf, weight_format="int4", threads=1, expert_slots=2, gpu_device="cpu")
    assert cached.decode_path == "modules" and "expert cache" in cached.decode_path_reason
    stats = cached.generate(IDS[:4], max_new_tokens=12, ignore_eos=True).stats
    assert stats["experts_gpu_per_token"] > 0 and stats["expert_hit_rate"] > 0
    assert stats["experts_gpu_per_token"] + stats["experts_cpu_per_token"] == pytest.approx(per_token, abs=2e-3)
    in_ram = _engine(moe_gguf, weight_format="int4", threads=1, expert_slots=0, gpu_device="cpu")
    assert in_ram.decode_path == "fused", in_ram.decode_path_reason
    stats = in_ram.generate(IDS[:4], max_new_tokens=12, ignore_eos=True).stats
    assert (stats["experts_cpu_per_token"], stats["experts_gpu_per_token"], stats["expert_hit_rate"]) == (per_token, 0, 0)
