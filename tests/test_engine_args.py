"""EngineArgs: one validated record behind Engine.load and the generate / perplexity / serve flags; the
executor contract behind the Engine's questions to its executor."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
import torch

from offline.collect import base_executor
from online import Engine
from online.cli import add_parsers
from online.engine_args import EngineArgs, add_engine_arguments
from online.execution.hybrid import HybridExecutor
from online.server.cli import add_serve_parser, run_serve
from tandem.core.errors import TandemError
from tandem.core.ffn import DenseExecutor
from tandem.core.ffn.contract import Executor

ENGINE_FLAGS = ["--threads", "3", "--plan", "p", "--context", "64", "--weight-format", "int4", "--gpu-budget", "1MiB",
                "--gpu-device", "cpu", "--no-sparse", "--down-format", "int8b", "--no-fused-decode", "--profile", "pr",
                "--predictors", "pd", "--expert-slots", "2", "--no-prefetch"]
EXPECTED = EngineArgs(model="m", threads=3, plan="p", context_length=64, weight_format="int4", gpu_budget_bytes=1 << 20,
                      gpu_device="cpu", sparse=False, down_format="int8b", fused_decode=False, profile="pr",
                      predictors="pd", expert_slots=2, prefetch=False)


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    root = argparse.ArgumentParser()
    sub = root.add_subparsers(dest="command")
    add_parsers(sub)
    add_serve_parser(sub)
    return {name: sub.choices[name] for name in ("generate", "perplexity", "serve")}


def test_every_field_has_a_flag_and_the_three_commands_share_them():
    plain = argparse.ArgumentParser()
    add_engine_arguments(plain)
    dests = {a.dest for a in plain._actions} - {"help"}
    assert dests == {f.name for f in fields(EngineArgs)}
    extra = {"generate": ["--prompt", "x"], "perplexity": ["--text-file", "t"], "serve": []}
    for name, parser in command_parsers().items():
        assert dests <= {a.dest for a in parser._actions}, name
        parsed = parser.parse_args(["--model", "m", *ENGINE_FLAGS, *extra[name]])
        assert EngineArgs.from_namespace(parsed) == EXPECTED, name
        assert EngineArgs.from_namespace(parser.parse_args(["--model", "m", *extra[name]])) == EngineArgs("m"), name


@pytest.mark.parametrize("kwargs, message", [
    ({"threads": 0}, "threads must be an integer >= 1"),
    ({"threads": True}, "threads must be an integer"),
    ({"context_length": 0}, "context_length must be an integer >= 2"),
    ({"expert_slots": -1}, "expert_slots must be an integer >= 0"),
    ({"weight_format": "q3"}, "weight_format must be one of"),
    ({"down_format": "fp16"}, "down_format needs plan or weight_format"),
    ({"gpu_budget_bytes": 5}, "gpu_budget_bytes needs plan"),
    ({"layer_offload": True}, "layer_offload needs gpu_budget_bytes"),
    ({"layer_offload": True, "gpu_budget_bytes": 1, "plan": "p"}, "layer_offload replaces a plan"),
    ({"sparse": "no"}, "sparse must be true or false"),
    ({"colour": 1}, "unknown engine argument 'colour'"),
    ({"threads": 10**5}, "threads must be at most"),
    ({"profile": "p"}, "profile names a plan's profile directory: it needs plan"),
    ({"gpu_device": "cpu"}, "gpu_device places the GPU tier: it needs plan"),
])
def test_bad_arguments_name_the_field(kwargs, message):
    with pytest.raises(TandemError, match="^" + message):
        EngineArgs.create("m", **kwargs)
    with pytest.raises(TandemError, match="^" + message):
        Engine.load("no-such-model-is-ever-read", **kwargs)  # refused before anything loads


def test_serve_checks_engine_flags_before_binding_or_loading():
    parser = command_parsers()["serve"]
    with pytest.raises(TandemError, match="^threads must be"):
        run_serve(parser.parse_args(["--model", "no-such-model", "--threads", "0", "--port", "1"]))


def test_load_is_from_args_and_executors_keep_the_contract(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    dense = Engine.load(folder, threads=1)
    packed = Engine.from_args(EngineArgs(model=folder, threads=1, weight_format="int8"))
    assert dense.args == EngineArgs(model=str(folder), threads=1) and packed.args.weight_format == "int8"
    assert isinstance(dense.executor, Executor) and isinstance(packed.executor, Executor)
    assert not dense.executor.packed and packed.executor.packed and dense.decode_threads is None
    assert isinstance(packed.executor, HybridExecutor) and not isinstance(packed.executor, DenseExecutor)
    assert base_executor(dense) is dense.executor
    with pytest.raises(TandemError, match="dense float32 executor"):  # a packed engine is refused, not half-used
        base_executor(packed)
    ids = [1, 5, 9, 2]
    stats = packed.generate(ids, max_new_tokens=3, ignore_eos=True).stats
    assert 0.0 <= stats["ffn_sparsity"] <= 1.0 and stats["weight_format"] == "int8"
    assert "ffn_sparsity" not in dense.generate(ids, max_new_tokens=3, ignore_eos=True).stats


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA takes gpu_device cuda")
def test_gpu_device_cuda_without_cuda_is_refused_before_loading():
    with pytest.raises(TandemError, match="no CUDA device"):
        Engine.load("no-such-model-is-ever-read", plan="p", gpu_device="cuda")
