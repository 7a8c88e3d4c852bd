"""Shared fixtures: tiny random models built from transformers' config classes, the real default model."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no spinning OpenMP threads (see tandem/cli.py)

import pytest
import torch


def pytest_configure(config):
    """Step caches of models without a plan folder go to a folder of this run, not the user's cache."""
    import tempfile
    if not os.environ.get("TANDEM_STEP_CACHE_DIR"):
        os.environ["TANDEM_STEP_CACHE_DIR"] = tempfile.mkdtemp(prefix="tandem-steps-")
        config._tandem_steps_dir = os.environ["TANDEM_STEP_CACHE_DIR"]


def pytest_unconfigure(config):
    import shutil
    folder = getattr(config, "_tandem_steps_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY_COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=128)


def tiny_hf_model(kind: str):
    """A tiny random transformers model of the given kind (llama, llama-relu, opt, mixtral, qwen2_moe, ...)."""
    import transformers as tf
    torch.manual_seed(0)
    if kind == "opt":
        cfg = tf.OPTConfig(ffn_dim=128, word_embed_proj_dim=64, **TINY_COMMON)
        return tf.OPTForCausalLM(cfg)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                               intermediate_size=48, **TINY_COMMON)
        return tf.MixtralForCausalLM(cfg)
    if kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                intermediate_size=96, **TINY_COMMON)
        return tf.Qwen2MoeForCausalLM(cfg)
    if kind == "qwen2":
        cfg = tf.Qwen2Config(num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True, **TINY_COMMON)
        return tf.Qwen2ForCausalLM(cfg)
    if kind == "mistral":
        cfg = tf.MistralConfig(num_key_value_heads=2, intermediate_size=128, sliding_window=16, **TINY_COMMON)
        return tf.MistralForCausalLM(cfg)
    if kind == "qwen3":
        cfg = tf.Qwen3Config(num_key_value_heads=2, intermediate_size=128, head_dim=24, **TINY_COMMON)
        return _perturb_norms(tf.Qwen3ForCausalLM(cfg))
    if kind == "gemma3":  # windowed layers (rope base 10000) around a global one (1e6), attention scale,
        common = dict(TINY_COMMON, num_hidden_layers=3)  # softcapped logits, (1 + w) norms
        cfg = tf.Gemma3TextConfig(num_key_value_heads=2, intermediate_size=128, head_dim=32,
                                  query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=3.0,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                                  **common)
        return _perturb_norms(tf.Gemma3ForCausalLM(cfg))
    if kind == "llama-mqa":  # one KV group of four query heads: two threads split it in the fused steps
        cfg = tf.LlamaConfig(num_key_value_heads=1, intermediate_size=128, **TINY_COMMON)
        return tf.LlamaForCausalLM(cfg)
    acts = {"llama": "silu", "llama-relu": "relu"}
    if kind in acts:
        cfg = tf.LlamaConfig(num_key_value_heads=2, intermediate_size=128, hidden_act=acts[kind],
                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32},
                             **TINY_COMMON)
        return tf.LlamaForCausalLM(cfg)
    raise ValueError(kind)


def _perturb_norms(model):
    """Random norm weights (the default init is all ones / zeros, which hides a wrong norm)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: kind -> (folder with config.json + model.safetensors, the transformers model)."""
    made: dict[str, tuple[Path, object]] = {}

    def make(kind: str):
        if kind not in made:
            model = tiny_hf_model(kind).eval()
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(folder)
            made[kind] = (folder, model)
        return made[kind]
    return make


def default_gguf_path() -> Path:
    from tandem.core.loading.resolve import resolve_model_path
    return resolve_model_path("smollm2")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_int4_engine():
    """SmolLM2 packed int4 on the fused step (2 threads); skipped when the model is not in models/. Tests that
    switch its step's kernels (use_library) switch them back."""
    from online import Engine
    from tandem.core.loading.resolve import resolve_model_path
    try:
        resolve_model_path("smollm2")
    except Exception:
        pytest.skip("SmolLM2 is not in models/")
    engine = Engine.load("smollm2", threads=2, weight_format="int4")
    assert engine.compiled_decode is not None, engine.decode_path_reason
    return engine


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    from online import Engine
    return Engine.load(str(smollm2_path))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own load of the same GGUF (float32); ~30 s, so once per session."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy machine threads waiting for each other cost
    seconds: modules that use it set ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_eviction(monkeypatch):
    """The probe's eviction (online.kind_probe: a read of the last-level cache's size plus 96 MB before each timed
    pass, ~400 MB on the Intel VM) cut to 8 MB: tests time tiny passes, and only their plumbing."""
    from online import kind_probe

    monkeypatch.setattr(kind_probe, "evict_bytes", lambda: 8 * 2**20)
    kind_probe._evict_buffer.cache_clear()
    yield
    kind_probe._evict_buffer.cache_clear()
