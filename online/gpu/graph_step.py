"""Running a decode program (``program.build_program``): launch groups captured once as CUDA graphs and
replayed per token, host actions between them. Without CUDA (or with ``capture=False``) the same
program runs eagerly, which is how its logic is tested on a CPU tier.

``GpuDecodeStep`` is the engine's compiled step for a plan whose layers all have their attention
on the tier (hot/cold FFN splits, host or tier head and embeddings); layer offload runs its GPU layers
through ``GpuLayers`` and the rest through the fused C step.

Example::

    step = GpuDecodeStep.build(model, executor)       # raises GpuStepUnavailable where it does not apply
    logits = step(token_id, pos, cache)               # [vocab] float32 on the host
    step.graphs_per_token, step.launches_per_token    # 1, 182 for a plan with everything on the GPU
"""
from __future__ import annotations

import torch

from tandem.core.errors import TandemError

from .ops import Ops
from .program import build_program
from .stack import GpuStepUnavailable, Host, Launch, StepContext


class ProgramRunner:
    """Groups of consecutive launches (each a CUDA graph after the first token) and host actions."""

    def __init__(self, ctx: StepContext, actions: list, capture: bool) -> None:
        self.ctx, self.capture = ctx, capture and ctx.device.type == "cuda"
        self.items: list = []  # ("launch", [fns]) | ("host", fn)
        self.after: list = [a.run for a in actions if isinstance(a, Host) and not a.barrier]
        for action in actions:
            if isinstance(action, Launch):
                if self.items and self.items[-1][0] == "launch":
                    self.items[-1][1].append(action.run)
                else:
                    self.items.append(("launch", [action.run]))
            elif action.barrier:
                self.items.append(("host", action.run))
        self.graphs: list | None = None
        self.launches_per_token = 0
        self.groups_per_token = sum(1 for kind, _ in self.items if kind == "launch")

    def run(self) -> None:
        if self.graphs is None:
            self._run_eager()
            if self.capture:
                self.graphs = [self._capture(fns) if kind == "launch" else None for kind, fns in self.items]
        else:
            state = self.ctx.state
            for (kind, item), graph in zip(self.items, self.graphs):
                if graph is not None:
                    state["host_fresh"] = False  # the launches may change the residual stream
                    graph.replay()
                else:
                    item()
        for fn in self.after:
            fn()

    def _run_eager(self) -> None:
        ops = self.ctx.ops
        before = ops.launches
        for kind, item in self.items:
            if kind == "launch":
                self.ctx.state["host_fresh"] = False
                for fn in item:
                    fn()
            else:
                item()
        self.launches_per_token = ops.launches - before

    def _capture(self, fns: list):
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
        return graph


class GpuLayers:
    """Layers ``[first, last)`` (and the head when ``head``) as a program on the tier."""

    def __init__(self, model, executor, first: int, last: int, head: bool, capture: bool = True,
                 backend: str | None = None) -> None:
        tier = executor.tier
        self.tier, self.executor = tier, executor
        self.ctx = StepContext.create(tier.device, model.cfg.hidden_size, Ops.create(tier.device, backend))
        self.runner_actions = build_program(model, executor, self.ctx, first, last, head)
        self.runner = ProgramRunner(self.ctx, self.runner_actions, capture)
        caches = [b.self_attn.capacity_tokens for b in list(model.layers)[first:last]
                  if getattr(b.self_attn, "on_tier", False)]
        self.capacity_tokens = min(caches) if caches else None  # the tier's KV caches (the plan's context)

    def run(self, token_id: int, pos: int, cache) -> None:
        ctx, tier = self.ctx, self.tier
        if self.capacity_tokens is not None and not 0 <= pos < self.capacity_tokens:
            raise TandemError(f"context of {pos + 1} tokens exceeds the {self.capacity_tokens}-token KV cache the plan "
                              f"put on the GPU tier (plan again with a larger --context)")
        ctx.state.update(token_id=token_id, pos=pos, cache=cache)
        syncs, link = ctx.syncs, ctx.link_bytes
        replayed = self.runner.graphs is not None  # the first token runs eagerly, then is captured
        self.runner.run()
        tier.exchanges += ctx.syncs - syncs
        tier.link_bytes += ctx.link_bytes - link
        tier.tier_calls += 1
        tier.launches += self.runner.launches_per_token
        tier.graph_replays += self.runner.groups_per_token if replayed else 0

    @property
    def launches_per_token(self) -> int:
        return self.runner.launches_per_token

    @property
    def graphs_per_token(self) -> int:
        return self.runner.groups_per_token


class GpuDecodeStep:
    """The whole model's decode token through ``GpuLayers`` (prefill runs through the modules, which write
    the same tier KV caches)."""
    prefills_natively = False

    def __init__(self, layers: GpuLayers) -> None:
        self.layers = layers

    @classmethod
    def build(cls, model, executor, capture: bool = True, backend: str | None = None) -> "GpuDecodeStep":
        if not getattr(executor, "packed", False) or not hasattr(executor, "tier"):
            raise GpuStepUnavailable("no GPU step: the executor has no tier")
        return cls(GpuLayers(model, executor, 0, model.cfg.num_layers, head=True, capture=capture, backend=backend))

    @torch.inference_mode()
    def __call__(self, token_id: int, pos: int, cache) -> torch.Tensor:
        self.layers.run(token_id, pos, cache)
        return self.layers.ctx.state.pop("logits")

    @property
    def launches_per_token(self) -> int:
        return self.layers.launches_per_token

    @property
    def graphs_per_token(self) -> int:
        return self.layers.graphs_per_token
