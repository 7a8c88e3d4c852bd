"""``tandem serve``: load a model and serve the OpenAI-compatible API with uvicorn.

Example::

    parser = argparse.ArgumentParser(); subparsers = parser.add_subparsers(dest="command")
    add_serve_parser(subparsers)
    args = parser.parse_args(["serve", "--model", "smollm2"])
    run_serve(args)  # blocks until Ctrl+C; returns the exit code
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading

from online.engine_args import EngineArgs, add_engine_arguments
from tandem.core.errors import TandemError

API_KEY_ENV = "TANDEM_API_KEY"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command (its ``func`` default is :func:`run_serve`)."""
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics.")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV} if set)")
    p.add_argument("--max-queue", type=int, default=64, help="requests allowed to wait; more get 429 (default 64)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may wait and generate in total (default 300)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's id)")
    p.add_argument("--kv-budget", default=None,
                   help="bytes of the paged KV pool shared by all requests, e.g. 256MiB (default: --max-batch "
                        "full contexts, capped at 256MiB, at least one full context)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=128,
                   help="prompt tokens prefilled per batching step, so running streams keep their pace (default 128)")
    p.add_argument("--prefill", default="step", choices=("modules", "step"),
                   help="prompt prefill: step (default: through the fused batched decode step, beside the decode "
                        "tokens) or modules (batched module graph, one chunk per step)")
    p.add_argument("--max-batch", type=int, default=32, help="sequences stepped together at most (default 32)")
    p.add_argument("--schedule", default="fcfs", choices=("fcfs", "mlfq"),
                   help="fcfs (default) or mlfq: FastServe's skip-join multi-level feedback queue")
    p.add_argument("--speculate", default=None, metavar="{off,lookup,sparse,auto}",
                   help="exact speculative decoding inside the batching loop: drafted tokens ride in the batched "
                        "step while at most --spec-max-seqs sequences run (see `tandem generate --help`)")
    p.add_argument("--spec-max-seqs", type=int, default=None, metavar="N",
                   help="speculate only while at most N sequences are being served (default 2); above, batching alone")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="K", help="most tokens drafted per verify step")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run_serve)
    return p


def batch_config(args: argparse.Namespace):
    """The BatchConfig the serve flags describe (one-line TandemError for bad values)."""
    from online.server.batch_config import BatchConfig, parse_bytes
    budget = parse_bytes(args.kv_budget) if getattr(args, "kv_budget", None) is not None else None
    try:
        return BatchConfig(kv_budget_bytes=budget, prefill_chunk_tokens=args.prefill_chunk_tokens,
                           max_batch_seqs=args.max_batch, schedule=args.schedule,
                           prefill=getattr(args, "prefill", "step"),
                           spec_max_seqs=2 if getattr(args, "spec_max_seqs", None) is None else args.spec_max_seqs)
    except TandemError as exc:  # BatchConfig names its fields; the command line knows them as flags
        message = str(exc)
        for field_name, flag in BATCH_FLAGS.items():
            if message.startswith(field_name):
                message = flag + message[len(field_name):]
        raise TandemError(message) from None


BATCH_FLAGS = {"max_batch_seqs": "--max-batch", "prefill_chunk_tokens": "--prefill-chunk-tokens",
               "spec_max_seqs": "--spec-max-seqs", "kv_budget_bytes": "--kv-budget", "schedule": "--schedule"}


def _validate(args: argparse.Namespace) -> str | None:
    if not 1 <= args.port <= 65535:
        raise TandemError(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_queue < 1:
        raise TandemError(f"--max-queue must be at least 1, got {args.max_queue}")
    if not args.request_timeout > 0:
        raise TandemError(f"--request-timeout must be positive, got {args.request_timeout}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise TandemError("--api-key must not be empty")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise TandemError("--served-model-name must not be empty")
    if getattr(args, "spec_max_seqs", None) is not None and getattr(args, "speculate", None) in (None, "off"):
        raise TandemError("--spec-max-seqs bounds speculation: it needs --speculate lookup, sparse or auto")
    return api_key


def _bind(host: str, port: int) -> socket.socket:
    """Open the listening socket up front so a busy port is a one-line error, not a traceback."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise TandemError(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    family, kind, proto, _name, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)  # now, not after the model loads: a second server on this port fails here, in one line
    except OSError as exc:
        sock.close()
        raise TandemError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> int:
    """Load the engine, bind the socket and serve until interrupted. Returns the exit code."""
    api_key = _validate(args)
    engine_args = EngineArgs.from_namespace(args)  # checked before binding and loading
    batch = batch_config(args)
    from online.speculative import SpeculationConfig
    SpeculationConfig.parse(getattr(args, "speculate", None), getattr(args, "draft_tokens", None))  # before loading
    sock = _bind(args.host, args.port)
    previous = None
    if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        import uvicorn

        from online import Engine
        from online.server.app import create_app

        engine = Engine.from_args(engine_args)
        if getattr(args, "speculate", None) is not None:
            shown = engine.set_default_speculation(args.speculate, args.draft_tokens)
            if args.speculate in ("lookup", "sparse") and shown["speculate"] == "off":  # asked for by name
                raise TandemError(f"--speculate {args.speculate}: {shown.get('speculate_reason', 'cannot run here')}")
            print(f"speculate: {shown['speculate']}" + (f" ({shown['speculate_reason']})"
                                                          if "speculate_reason" in shown else ""), file=sys.stderr)
        app = create_app(engine, api_key=api_key, max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                         served_model_name=args.served_model_name, batch=batch)
        if api_key is None and not _is_loopback(args.host):
            print(f"warning: serving on {args.host} without --api-key: anyone who can reach this port can use it",
                  file=sys.stderr)
        shown_host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"serving {engine.model_id} at http://{shown_host}:{args.port}/v1 (Ctrl+C to stop)", file=sys.stderr)
        b = app.state.scheduler.describe()
        print(f"batching: {b['path']} decode path, prefill {b['prefill']}, up to {b['max_batch_seqs']} sequences, "
              f"{b['schedule']}; KV pool {b['kv_pool_bytes'] / 2**20:.0f} MiB of {b['kv_cache_type']} "
              f"({b['kv_pool_blocks'] * b['kv_block_tokens']} tokens)" + (f"; {b['note']}" if "note" in b else ""),
              file=sys.stderr)
        spec = b["speculation"]
        print(f"speculation: {spec['mode']} ({spec['reason']})", file=sys.stderr)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    except _Terminated:  # SIGTERM: uvicorn shut down gracefully and passed the signal on (or it came while loading)
        pass
    finally:
        sock.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


class _Terminated(Exception):
    """SIGTERM, as an exception: a stop asked for, which ends `tandem serve` with exit code 0."""


def _raise_terminated(_signum, _frame) -> None:
    raise _Terminated()
