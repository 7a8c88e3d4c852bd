"""One layer's actions in a GPU-step program (``program.build_program``): attention on the tier or on the
host (one C call, else the module), then the FFN's hot rows on the tier while the host computes its cold
rows (one C call, else the Python CPU part), merged before the next layer reads the residual stream.

Each layer that uses both devices makes one exchange: the host fetches the residual stream (or has it,
after host attention) while the tier starts the hot rows, and sends back the cold rows' output.

Example::

    actions = attention_actions(ctx, model, block, 3, rope, c_layers)
    actions += ffn_actions(ctx, executor, block, 3, input_on_host=False, c_layers=c_layers)
"""
from __future__ import annotations

import numpy as np
import torch

from .cpu_runs import ATTENTION, BOTH, FFN, CpuLayers
from .ops import Mat
from .stack import Host, Launch, StepContext, _device_copy, fuse_rows


def attention_on_tier(block) -> bool:
    return getattr(block.self_attn, "on_tier", False)


def attention_actions(ctx: StepContext, model, block, layer: int, rope: dict, c_layers: CpuLayers | None) -> list:
    """``rope``: local_rope (bool) -> (cos, sin) tables on the device (Gemma 3's windowed layers use the local one)."""
    if attention_on_tier(block):
        return [_tier_attention(ctx, block, layer, model.cfg, rope)]
    if c_layers is not None and c_layers.attention(layer):
        def in_c() -> None:
            x = ctx.residual_on_host()
            c_layers.run(layer, layer + 1, ctx.state["pos"], ctx.state["cache"], x, ATTENTION)
            ctx.send_residual()
        return [Host(in_c, f"C attention {layer}")]
    return [_module_attention(ctx, model, block, layer)]


def _tier_attention(ctx: StepContext, block, layer: int, cfg, rope: dict) -> Launch:
    """Norm + q/k/v (one launch where they share a format), (q/k norms +) rope + KV write, attention (over
    the window on windowed layers), o + residual (through the sandwich norm where the model has one)."""
    attn, ops = block.self_attn, ctx.ops
    norm1 = _device_copy(block.input_layernorm.weight, ctx.device)
    parts = attn.qkv_parts
    fused = len({(p.fmt, p.cols) for p in parts}) == 1
    qkv_mats = [fuse_rows(parts)] if fused else [Mat.of(p) for p in parts]
    o_w = Mat.of(attn.o)
    H, KV, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    qkv = ctx.buffer("qkv", (H + 2 * KV) * hd)
    slices, begin = [], 0
    for m in qkv_mats:  # each matrix's rows of the q/k/v buffer (its bias too)
        slices.append((qkv[begin:begin + m.rows], None if attn.qkv_bias is None else attn.qkv_bias[begin:begin + m.rows]))
        begin += m.rows
    q, out = ctx.buffer("q", H * hd), ctx.buffer("attn", H * hd)
    cos, sin = rope[bool(getattr(attn, "local_rope", False))]
    q_norm = _device_copy(attn.q_norm.weight, ctx.device) if hasattr(attn, "q_norm") else None
    k_norm = _device_copy(attn.k_norm.weight, ctx.device) if hasattr(attn, "k_norm") else None
    window = int(getattr(attn, "sliding_window", 0) or 0)
    post = _device_copy(block.attn_output_norm.weight, ctx.device) if cfg.sandwich_norms else None
    o_out = ctx.buffer("o_out", o_w.rows) if post is not None else None

    def run() -> None:
        for m, (rows, bias) in zip(qkv_mats, slices):
            ops.matvec(ctx.x, m, rows, norm=norm1, eps=cfg.norm_eps, b1=bias)
        ops.rope_kv(qkv, q, attn.keys, attn.values, cos, sin, ctx.pos, H, KV, hd, q_norm=q_norm, k_norm=k_norm,
                    eps=cfg.norm_eps)
        ops.attention(q, attn.keys, attn.values, out, ctx.pos, attn.scale, H, KV, hd, window=window)
        if post is None:
            ops.matvec(out, o_w, ctx.x, b1=attn.o_bias, residual=ctx.x)
        else:
            ops.matvec(out, o_w, o_out, b1=attn.o_bias)
            ops.rmsnorm(o_out, post, ctx.x, cfg.norm_eps, add=True)
    return Launch(run, f"attention {layer}")


def _module_attention(ctx: StepContext, model, block, layer: int) -> Host:
    """The layer's attention through its (CPU) module: the residual stream fetched, updated, sent back."""
    def run() -> None:
        st = ctx.state
        x = ctx.residual_on_host()[None]  # [1, d]
        pos = st["pos"]
        attn = block.self_attn
        table = (model.rope_local_cos, model.rope_local_sin) if getattr(attn, "local_rope", False) else \
            (model.rope_cos, model.rope_sin)
        cos = sin = None
        if table[0] is not None:
            cos, sin = table[0][pos:pos + 1], table[1][pos:pos + 1]
        h = attn(block.input_layernorm(x), layer, pos, st["cache"], cos, sin)
        x = x + (block.attn_output_norm(h) if model.cfg.sandwich_norms else h)
        ctx.x_host.copy_(x[0])
        ctx.send_residual()
    return Host(run, f"host attention {layer}")


def ffn_actions(ctx: StepContext, executor, block, layer: int, input_on_host: bool, c_layers: CpuLayers | None) -> list:
    """Hot rows on the tier, cold rows on the host at the same time, merged before the next layer.
    ``input_on_host``: the attention ran on the host, whose ``x_host`` is the residual stream already.
    With sandwich norms (Gemma 3) the hot and cold rows are summed first, then normed into the stream."""
    split, ops, cfg = executor.splits[layer], ctx.ops, executor.cfg
    hot, cold = split.gpu, split.cpu
    cold_in_c = cold is not None and c_layers is not None and c_layers.ffn(layer)
    n_ff = split.cpu_neurons.numel() + (hot.neurons.numel() if hot is not None else 0)
    n_hot = hot.neurons.numel() if hot is not None else 0
    counters = executor.counters
    norm2 = _device_copy(block.post_attention_layernorm.weight, ctx.device)
    # the FFN output's own norm: applied here, after the hot and cold rows are summed, unless the whole FFN runs
    # in C (which applies it itself; for a layer with hot rows CpuLayers leaves it out of the C call)
    whole_in_c = cold_in_c and hot is None
    post = _device_copy(block.ffn_output_norm.weight, ctx.device) if cfg.sandwich_norms and not whole_in_c else None
    acc = ctx.buffer("ffn_out", cfg.hidden_size) if post is not None else ctx.x  # what the FFN's rows add into
    actions = []
    if cold is not None and not input_on_host:  # the cold rows' input, fetched while the hot rows run
        if not cold_in_c:
            actions.append(Launch(lambda: ops.rmsnorm(ctx.x, norm2, ctx.hn, cfg.norm_eps), f"cold input {layer}"))
        src, dst = (ctx.x, ctx.x_host) if cold_in_c else (ctx.hn, ctx.hn_host)
        actions.append(Host(lambda: ctx.fetch_async(src, dst), f"fetch cold input {layer}"))
    if hot is not None:
        bias = _device_copy(split.down_bias, ctx.device) if not cold_in_c else None  # C adds it with the cold rows
        actions.append(Launch(_hot_rows(ctx, hot, norm2, bias, cfg, acc, zero=post is not None), f"hot FFN {layer}"))

    def count() -> None:
        counters.ffn_neurons_total += n_ff
        counters.ffn_neurons_active += n_hot
    if cold is None:
        if post is not None:
            actions.append(Launch(lambda: ops.rmsnorm(acc, post, ctx.x, cfg.norm_eps, add=True), f"FFN norm {layer}"))
        return actions + [Host(count, f"count {layer}", barrier=False)]

    def run_cold() -> None:
        if not input_on_host:
            ctx.wait()
        if cold_in_c:
            x = ctx.x_host
            after = x.clone()
            counters.ffn_neurons_active += c_layers.run(layer, layer + 1, ctx.state["pos"], ctx.state["cache"],
                                                        after, FFN)
            ctx.y_cold_host.copy_(after - x)
        else:
            x = ctx.x_host[None] if input_on_host else None
            normed = block.post_attention_layernorm(x) if x is not None else ctx.hn_host[None]  # [1, d]
            y = executor._cpu_forward(split, normed)  # [1, d]
            if split.down_bias is not None and hot is None:
                y = y + split.down_bias
            ctx.y_cold_host.copy_(y[0])
        ctx.send(ctx.y_cold_host, ctx.y_cold)
        count()

    def merge() -> None:
        if post is None:
            ops.add(ctx.x, ctx.y_cold)
            return
        if hot is not None:
            ops.add(acc, ctx.y_cold)
        ops.rmsnorm(acc if hot is not None else ctx.y_cold, post, ctx.x, cfg.norm_eps, add=True)
    return actions + [Host(run_cold, f"cold FFN {layer}"), Launch(merge, f"merge {layer}")]


def _hot_rows(ctx: StepContext, hot, norm2, bias, cfg, out, zero: bool):
    """The hot rows' output added into ``out`` (the residual stream, or a zeroed accumulator with ``zero``)."""
    up, down = Mat.of(hot.up), Mat.of(hot.down_t)
    gate = Mat.of(hot.gate) if hot.gate is not None else None
    h, ops = ctx.buffer("h", up.rows), ctx.ops

    def run() -> None:
        if zero:
            ops.zero(out)
        ops.matvec(ctx.x, up, h, norm=norm2, eps=cfg.norm_eps, w2=gate, b1=hot.up_bias, b2=hot.gate_bias,
                   act=cfg.hidden_act)
        ops.matvec_t(h, down, out, bias=bias)
    return run


def c_layer_run(ctx: StepContext, executor, c_layers: CpuLayers, first: int, last: int, logits: bool = False) -> Host:
    """Whole CPU layers ``[first, last)``: one exchange, one C call; with ``logits`` that call ends with the
    output layer (into ``ctx.state["logits"]``) and the residual stream stays on the host."""
    n_ff = sum(executor.splits[i].cpu_neurons.numel() for i in range(first, last))
    counters = executor.counters
    vocab = c_layers.vocab

    def run() -> None:
        x = ctx.residual_on_host()
        # numpy's allocation, as the fused step's (a fresh torch.empty page-faults every token)
        out = torch.from_numpy(np.empty(vocab, dtype=np.float32)) if logits else None  # [vocab]
        counters.ffn_neurons_active += c_layers.run(first, last, ctx.state["pos"], ctx.state["cache"], x, BOTH,
                                                    logits=out)
        counters.ffn_neurons_total += n_ff
        if logits:
            ctx.state["logits"] = out
        else:
            ctx.send_residual()
    name = f"C layers {first}-{last - 1}" if last > first else "C output layer"
    return Host(run, name + (" + output layer" if logits and last > first else ""))
