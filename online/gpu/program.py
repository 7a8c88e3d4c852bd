"""The decode token as a program (``stack.Launch`` / ``stack.Host`` actions) for layers ``[first, last)``
of a model whose units sit on the tier, ending with the logits or with the residual stream on the host.

Example::

    ctx = StepContext.create(tier.device, cfg.hidden_size, Ops.create(tier.device))
    program = build_program(model, executor, ctx, 0, cfg.num_layers, head=True)
    ctx.state.update(token_id=5, pos=12, cache=cache); run_eager(program)   # ctx.state["logits"] [vocab]
"""
from __future__ import annotations

import torch

from .cpu_runs import CpuLayerRuns, pure_cpu_layer
from .ops import Mat
from .stack import GpuStepUnavailable, Host, Launch, StepContext, _device_copy, check_model, fuse_rows


def _attention_on_tier(block) -> bool:
    return getattr(block.self_attn, "on_tier", False)


def _layer_attention(ctx: StepContext, block, layer: int, cfg, rope) -> list:
    """Norm, q/k/v, rope + KV write, attention, o + residual: all on the tier."""
    attn, ops, dev = block.self_attn, ctx.ops, ctx.device
    norm1 = _device_copy(block.input_layernorm.weight, dev)
    qkv_w = fuse_rows(attn.qkv_parts)
    H, KV, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    o_w = Mat.of(attn.o)
    q_dim = H * hd
    qkv = ctx.buffer("qkv", qkv_w.rows)
    q, out = ctx.buffer("q", q_dim), ctx.buffer("attn", q_dim)
    cos, sin = rope

    def run() -> None:
        ops.matvec(ctx.x, qkv_w, qkv, norm=norm1, eps=cfg.norm_eps, b1=attn.qkv_bias)
        ops.rope_kv(qkv, q, attn.keys, attn.values, cos, sin, ctx.pos, H, KV, hd)
        ops.attention(q, attn.keys, attn.values, out, ctx.pos, attn.scale, H, KV, hd)
        ops.matvec(out, o_w, ctx.x, b1=attn.o_bias, residual=ctx.x)
    return [Launch(run, f"attention {layer}")]


def _layer_attention_on_host(ctx: StepContext, model, block, layer: int) -> list:
    """The layer's attention through its (CPU) module: the residual stream fetched, updated, sent back."""
    def run() -> None:
        st = ctx.state
        x = ctx.fetch(ctx.x, ctx.x_host)[None]  # [1, d]
        pos = st["pos"]
        cos = sin = None
        if model.rope_cos is not None:
            cos, sin = model.rope_cos[pos:pos + 1], model.rope_sin[pos:pos + 1]
        x = x + block.self_attn(block.input_layernorm(x), layer, pos, st["cache"], cos, sin)
        ctx.x_host.copy_(x[0])
        ctx.send(ctx.x_host, ctx.x)
        ctx.hn_host.copy_(block.post_attention_layernorm(x)[0])  # a cold part's input, already here
    return [Host(run, f"host attention {layer}")]


def _layer_ffn(ctx: StepContext, executor, block, layer: int, cfg, input_on_host: bool) -> list:
    """Hot rows on the tier, cold rows on the CPU at the same time, merged before the next layer.
    ``input_on_host``: the attention ran on the host, which holds the cold rows' input already."""
    split, ops, dev = executor.splits[layer], ctx.ops, ctx.device
    norm2 = _device_copy(block.post_attention_layernorm.weight, dev)
    hot, cold = split.gpu, split.cpu
    n_ff = split.cpu_neurons.numel() + (hot.neurons.numel() if hot is not None else 0)
    counters = executor.counters
    bias_on_tier = _device_copy(split.down_bias, dev) if hot is not None else None
    actions = []
    if cold is not None and not input_on_host:
        def send_cold_input() -> None:  # the cold rows' input, fetched while the hot rows run
            ops.rmsnorm(ctx.x, norm2, ctx.hn, cfg.norm_eps)
        actions.append(Launch(send_cold_input, f"cold input {layer}"))
        actions.append(Host(lambda: _start_fetch(ctx), f"fetch cold input {layer}"))
    if hot is not None:
        up, down = Mat.of(hot.up), Mat.of(hot.down_t)
        gate = Mat.of(hot.gate) if hot.gate is not None else None
        h = ctx.buffer("h", up.rows)

        def run_hot() -> None:
            if gate is not None:
                ops.matvec(ctx.x, up, h, norm=norm2, eps=cfg.norm_eps, w2=gate, b1=hot.up_bias, b2=hot.gate_bias,
                           act=cfg.hidden_act)
            else:
                ops.matvec(ctx.x, up, h, norm=norm2, eps=cfg.norm_eps, b1=hot.up_bias, act=cfg.hidden_act)
            ops.matvec_t(h, down, ctx.x, bias=bias_on_tier)
        actions.append(Launch(run_hot, f"hot FFN {layer}"))
    n_hot = hot.neurons.numel() if hot is not None else 0

    def count() -> None:
        counters.ffn_neurons_total += n_ff
        counters.ffn_neurons_active += n_hot
    if cold is not None:
        def run_cold() -> None:
            x = (ctx.hn_host if input_on_host else _finish_fetch(ctx))[None]  # [1, d]
            y = executor._cpu_forward(split, x)  # [1, d]
            if split.down_bias is not None and hot is None:
                y = y + split.down_bias
            ctx.y_cold_host.copy_(y[0])
            ctx.send(ctx.y_cold_host, ctx.y_cold)
            count()
        actions.append(Host(run_cold, f"cold FFN {layer}"))
        actions.append(Launch(lambda: ops.add(ctx.x, ctx.y_cold), f"merge {layer}"))
    else:
        actions.append(Host(count, f"count {layer}", barrier=False))
    return actions


def _start_fetch(ctx: StepContext) -> None:
    ctx.hn_host.copy_(ctx.hn, non_blocking=True)
    ctx.link_bytes += ctx.hn.numel() * 4
    if ctx.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        ctx.state["cold_event"] = event


def _finish_fetch(ctx: StepContext) -> torch.Tensor:
    event = ctx.state.pop("cold_event", None)
    if event is not None:
        event.synchronize()
    ctx.syncs += 1
    return ctx.hn_host


def build_program(model, executor, ctx: StepContext, first: int, last: int, head: bool) -> list:
    """Actions for one token: input (embedding), layers ``[first, last)``, then the logits (``head``) into
    ``ctx.state["logits"]`` or the residual stream into ``ctx.x_host``."""
    check_model(model)
    cfg, dev, ops = model.cfg, ctx.device, ctx.ops
    for layer in range(first, last):
        split = executor.splits[layer] if layer < len(executor.splits) else None
        if split is None:
            raise GpuStepUnavailable(f"layer {layer} has no split FFN (MoE)")
        if split.gpu is None and split.cpu is None:
            raise GpuStepUnavailable(f"layer {layer} has no FFN part")
    if any(not _attention_on_tier(model.layers[i]) for i in range(first, last)) and first > 0:
        raise GpuStepUnavailable("host attention only in a whole-model program")
    rope = (None, None)
    if model.rope_cos is not None:
        capacity = max(int(b.self_attn.keys.shape[1]) for b in model.layers if _attention_on_tier(b)) \
            if any(_attention_on_tier(b) for b in model.layers) else 1
        rope = (model.rope_cos[:capacity].contiguous().to(dev), model.rope_sin[:capacity].contiguous().to(dev))
    actions: list = [Host(lambda: _send_inputs(ctx), "inputs")]
    if first == 0:
        actions += _embedding(ctx, model)
    cpu_layers = [i for i in range(first, last) if pure_cpu_layer(model, executor, i)]
    runs = CpuLayerRuns.build(model, executor, cpu_layers)
    layer = first
    while layer < last:
        if runs is not None and layer in runs.layers:  # a run of whole CPU layers: one exchange, one C call
            end = layer
            while end < last and end in runs.layers:
                end += 1
            actions.append(_cpu_run(ctx, executor, runs, layer, end))
            layer = end
            continue
        block = model.layers[layer]
        on_tier = _attention_on_tier(block)
        if on_tier:
            actions += _layer_attention(ctx, block, layer, cfg, rope)
        else:
            actions += _layer_attention_on_host(ctx, model, block, layer)
        actions += _layer_ffn(ctx, executor, block, layer, cfg, input_on_host=not on_tier)
        layer += 1
    actions += _logits(ctx, model, executor) if head else [Host(lambda: ctx.fetch(ctx.x, ctx.x_host), "residual out")]
    return actions


def _cpu_run(ctx: StepContext, executor, runs: CpuLayerRuns, first: int, last: int) -> Host:
    n_ff = sum(executor.splits[i].cpu_neurons.numel() for i in range(first, last))
    counters = executor.counters

    def run() -> None:
        x = ctx.fetch(ctx.x, ctx.x_host)
        counters.ffn_neurons_active += runs.run(first, last, ctx.state["pos"], ctx.state["cache"], x)
        counters.ffn_neurons_total += n_ff
        ctx.send(ctx.x_host, ctx.x)
    return Host(run, f"C layers {first}-{last - 1}")


def _send_inputs(ctx: StepContext) -> None:
    ctx.inputs_host[0], ctx.inputs_host[1] = ctx.state["token_id"], ctx.state["pos"]
    ctx.send(ctx.inputs_host, ctx.inputs)


def _embedding(ctx: StepContext, model) -> list:
    table = getattr(model.embed_tokens, "table", None)
    scale = float(model.cfg.embed_scale)
    if table is not None and table.data.device == ctx.device:
        mat = Mat.of(table)
        return [Launch(lambda: ctx.ops.embed(ctx.token, mat, ctx.x, scale), "embed")]

    def on_host() -> None:
        ctx.x_host.copy_(model.embed(torch.tensor([ctx.state["token_id"]]), ctx.state["pos"])[0])
        ctx.send(ctx.x_host, ctx.x)
    return [Host(on_host, "host embedding")]


def _logits(ctx: StepContext, model, executor) -> list:
    cfg = model.cfg
    cap = cfg.final_logit_softcap
    norm = _device_copy(model.norm.weight, ctx.device)
    head = executor.tier_head
    if head is not None:
        mat = Mat.of(head)
        logits = ctx.buffer("logits", mat.rows)
        logits_host = torch.zeros(mat.rows, pin_memory=ctx.device.type == "cuda")

        def fetch() -> None:
            out = ctx.fetch(logits, logits_host).clone()
            ctx.state["logits"] = torch.tanh(out / cap) * cap if cap else out
        return [Launch(lambda: ctx.ops.matvec(ctx.x, mat, logits, norm=norm, eps=cfg.norm_eps), "head"),
                Host(fetch, "logits out")]

    def on_host() -> None:
        x = model.norm(ctx.fetch(ctx.x, ctx.x_host)[None])  # [1, d]
        out = executor.output_logits(x, model.lm_head.weight)[0]
        ctx.state["logits"] = torch.tanh(out / cap) * cap if cap else out
    return [Host(on_host, "host head")]
