"""The decode token as a program (``stack.Launch`` / ``stack.Host`` actions) for layers ``[first, last)``
of a model whose units sit on the tier, ending with the logits or with the residual stream on the host.

Example::

    ctx = StepContext.create(tier.device, cfg.hidden_size, Ops.create(tier.device))
    runner = ProgramRunner(ctx, build_program(model, executor, ctx, 0, cfg.num_layers, head=True), capture=True)
    ctx.state.update(token_id=5, pos=12, cache=cache); runner.run()   # ctx.state["logits"] [vocab]
"""
from __future__ import annotations

import torch

from .cpu_runs import CpuLayers
from .layer_actions import attention_actions, attention_on_tier, c_layer_run, ffn_actions
from .ops import Mat
from .stack import GpuStepUnavailable, Host, Launch, StepContext, _device_copy, check_model


def build_program(model, executor, ctx: StepContext, first: int, last: int, head: bool) -> list:
    """Actions for one token: input (embedding), layers ``[first, last)``, then the logits (``head``) into
    ``ctx.state["logits"]`` or the residual stream into ``ctx.x_host``."""
    check_model(model)
    dev = ctx.device
    for layer in range(first, last):
        split = executor.splits[layer] if layer < len(executor.splits) else None
        if split is None:
            raise GpuStepUnavailable(f"layer {layer} has no split FFN (MoE)")
        if split.gpu is None and split.cpu is None:
            raise GpuStepUnavailable(f"layer {layer} has no FFN part")
    if any(not attention_on_tier(model.layers[i]) for i in range(first, last)) and first > 0:
        raise GpuStepUnavailable("host attention only in a whole-model program")
    rope = {False: (None, None), True: (None, None)}  # by local_rope: the global table, Gemma 3's windowed layers'
    capacity = max((int(b.self_attn.keys.shape[1]) for b in model.layers if attention_on_tier(b)), default=1)
    for local, (cos, sin) in ((False, (model.rope_cos, model.rope_sin)), (True, (model.rope_local_cos, model.rope_local_sin))):
        if cos is not None:
            rope[local] = (cos[:capacity].contiguous().to(dev), sin[:capacity].contiguous().to(dev))
    actions: list = [Host(lambda: _send_inputs(ctx), "inputs")]
    c_layers = CpuLayers.build(model, executor, first, last)
    c_head = head and executor.tier_head is None and c_layers is not None and c_layers.has_head
    if first == 0:
        actions += _embedding(ctx, model, c_layers)
    layer = first
    while layer < last:
        if c_layers is not None and c_layers.whole(layer):  # a run of whole CPU layers: one exchange, one C call
            end = layer
            while end < last and c_layers.whole(end):
                end += 1
            with_logits = c_head and end == model.cfg.num_layers  # the output layer in the same call
            actions.append(c_layer_run(ctx, executor, c_layers, layer, end, logits=with_logits))
            if with_logits:
                return actions
            layer = end
            continue
        block = model.layers[layer]
        actions += attention_actions(ctx, model, block, layer, rope, c_layers)
        actions += ffn_actions(ctx, executor, block, layer, input_on_host=not attention_on_tier(block),
                               c_layers=c_layers)
        layer += 1
    if c_head:
        actions.append(c_layer_run(ctx, executor, c_layers, last, last, logits=True))  # the output layer alone
    else:
        actions += _logits(ctx, model, executor) if head else [Host(ctx.residual_on_host, "residual out")]
    return actions


def _send_inputs(ctx: StepContext) -> None:
    ctx.state["host_fresh"] = False  # x_host holds the last token's stream
    ctx.inputs_host.numpy()[:] = (ctx.state["token_id"], ctx.state["pos"])  # one write, not two tensor indexings
    ctx.send(ctx.inputs_host, ctx.inputs)


def _embedding(ctx: StepContext, model, c_layers: CpuLayers | None) -> list:
    table = getattr(model.embed_tokens, "table", None)
    scale = float(model.cfg.embed_scale)
    if table is not None and table.data.device == ctx.device:  # (GpuTier keeps the index: cuda:0)
        mat = Mat.of(table)
        return [Launch(lambda: ctx.ops.embed(ctx.token, mat, ctx.x, scale), "embed")]

    if c_layers is not None and c_layers.has_embed:
        def in_c() -> None:
            c_layers.embed(ctx.state["token_id"], ctx.state["pos"], ctx.x_host)
            ctx.send_residual()
        return [Host(in_c, "C embedding")]

    def on_host() -> None:
        ctx.x_host.copy_(model.embed(torch.tensor([ctx.state["token_id"]]), ctx.state["pos"])[0])
        ctx.send_residual()
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
        x = model.norm(ctx.residual_on_host()[None])  # [1, d]
        out = executor.output_logits(x, model.lm_head.weight)[0]
        ctx.state["logits"] = torch.tanh(out / cap) * cap if cap else out
    return [Host(on_host, "host head")]
