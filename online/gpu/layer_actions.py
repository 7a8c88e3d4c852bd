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


def attention_actions(ctx: StepContext, model, block, layer: int, rope, c_layers: CpuLayers | None) -> list:
    if attention_on_tier(block):
        return [_tier_attention(ctx, block, layer, model.cfg, rope)]
    if c_layers is not None and c_layers.attention(layer):
        def in_c() -> None:
            x = ctx.residual_on_host()
            c_layers.run(layer, layer + 1, ctx.state["pos"], ctx.state["cache"], x, ATTENTION)
            ctx.send_residual()
        return [Host(in_c, f"C attention {layer}")]
    return [_module_attention(ctx, model, block, layer)]


def _tier_attention(ctx: StepContext, block, layer: int, cfg, rope) -> Launch:
    """Norm + q/k/v (one launch), rope + KV write, attention, o + residual: all on the tier."""
    attn, ops = block.self_attn, ctx.ops
    norm1 = _device_copy(block.input_layernorm.weight, ctx.device)
    qkv_w, o_w = fuse_rows(attn.qkv_parts), Mat.of(attn.o)
    H, KV, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    qkv = ctx.buffer("qkv", qkv_w.rows)
    q, out = ctx.buffer("q", H * hd), ctx.buffer("attn", H * hd)
    cos, sin = rope

    def run() -> None:
        ops.matvec(ctx.x, qkv_w, qkv, norm=norm1, eps=cfg.norm_eps, b1=attn.qkv_bias)
        ops.rope_kv(qkv, q, attn.keys, attn.values, cos, sin, ctx.pos, H, KV, hd)
        ops.attention(q, attn.keys, attn.values, out, ctx.pos, attn.scale, H, KV, hd)
        ops.matvec(out, o_w, ctx.x, b1=attn.o_bias, residual=ctx.x)
    return Launch(run, f"attention {layer}")


def _module_attention(ctx: StepContext, model, block, layer: int) -> Host:
    """The layer's attention through its (CPU) module: the residual stream fetched, updated, sent back."""
    def run() -> None:
        st = ctx.state
        x = ctx.residual_on_host()[None]  # [1, d]
        pos = st["pos"]
        cos = sin = None
        if model.rope_cos is not None:
            cos, sin = model.rope_cos[pos:pos + 1], model.rope_sin[pos:pos + 1]
        x = x + block.self_attn(block.input_layernorm(x), layer, pos, st["cache"], cos, sin)
        ctx.x_host.copy_(x[0])
        ctx.send_residual()
    return Host(run, f"host attention {layer}")


def ffn_actions(ctx: StepContext, executor, block, layer: int, input_on_host: bool, c_layers: CpuLayers | None) -> list:
    """Hot rows on the tier, cold rows on the host at the same time, merged before the next layer.
    ``input_on_host``: the attention ran on the host, whose ``x_host`` is the residual stream already."""
    split, ops, cfg = executor.splits[layer], ctx.ops, executor.cfg
    hot, cold = split.gpu, split.cpu
    cold_in_c = cold is not None and c_layers is not None and c_layers.ffn(layer)
    n_ff = split.cpu_neurons.numel() + (hot.neurons.numel() if hot is not None else 0)
    n_hot = hot.neurons.numel() if hot is not None else 0
    counters = executor.counters
    norm2 = _device_copy(block.post_attention_layernorm.weight, ctx.device)
    actions = []
    if cold is not None and not input_on_host:  # the cold rows' input, fetched while the hot rows run
        if not cold_in_c:
            actions.append(Launch(lambda: ops.rmsnorm(ctx.x, norm2, ctx.hn, cfg.norm_eps), f"cold input {layer}"))
        src, dst = (ctx.x, ctx.x_host) if cold_in_c else (ctx.hn, ctx.hn_host)
        actions.append(Host(lambda: ctx.fetch_async(src, dst), f"fetch cold input {layer}"))
    if hot is not None:
        bias = _device_copy(split.down_bias, ctx.device) if not cold_in_c else None  # C adds it with the cold rows
        actions.append(Launch(_hot_rows(ctx, hot, norm2, bias, cfg), f"hot FFN {layer}"))

    def count() -> None:
        counters.ffn_neurons_total += n_ff
        counters.ffn_neurons_active += n_hot
    if cold is None:
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
    return actions + [Host(run_cold, f"cold FFN {layer}"), Launch(lambda: ops.add(ctx.x, ctx.y_cold), f"merge {layer}")]


def _hot_rows(ctx: StepContext, hot, norm2, bias, cfg):
    up, down = Mat.of(hot.up), Mat.of(hot.down_t)
    gate = Mat.of(hot.gate) if hot.gate is not None else None
    h, ops = ctx.buffer("h", up.rows), ctx.ops

    def run() -> None:
        ops.matvec(ctx.x, up, h, norm=norm2, eps=cfg.norm_eps, w2=gate, b1=hot.up_bias, b2=hot.gate_bias,
                   act=cfg.hidden_act)
        ops.matvec_t(h, down, ctx.x, bias=bias)
    return run


def c_layer_run(ctx: StepContext, executor, c_layers: CpuLayers, first: int, last: int, logits: bool = False) -> Host:
    """Whole CPU layers ``[first, last)``: one exchange, one C call; with ``logits`` that call ends with the
    output layer (into ``ctx.state["logits"]``) and the residual stream stays on the host."""
    n_ff = sum(executor.splits[i].cpu_neurons.numel() for i in range(first, last))
    counters = executor.counters
    vocab = int(c_layers.step._desc.vocab)

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
