"""The prepared-step cache behind a torch-free ``Engine.load``: the fused C step's packed arrays and
descriptors (online/execution/step_cache.py) plus what the engine needs around them (config,
tokenizer, plan facts, stats), in one file beside the plan (``<plan>/step-cache/``; in
``~/.cache/tandem/steps`` when the plan folder cannot be written, or without a plan).

The file is keyed by a fingerprint of everything that decides its bytes: the model file (size,
mtime, a hash of its first MiB), the plan, profile and predictor files, the engine arguments that
change packing (weight/down formats, sparsity) and the code that packs (kernels, executors,
loaders). A file whose key differs is rebuilt, never trusted; an unreadable one too (with a warning).

Example::

    if cache_applies(args):
        parts = load_cached(args)         # CachedParts or None (missing / stale / corrupt)
    ...
    save_cached(engine, args)             # after a normal load built the fused step
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.core.errors import TandemError

from .engine_args import EngineArgs

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("tandem/core", "online/kernels", "online/execution", "predictors", "placement")
CODE_FILES = ("online/engine_build.py", "online/plan_runtime.py", "online/engine_cache.py", "offline/profile_artifact.py")
HEAD_HASH_BYTES = 1 << 20
SHARED_CAP_BYTES = 4 << 30  # the shared steps folder's bound (shared_cap_bytes)
SMALL_FILE_BYTES = 16 << 20  # plan/profile/predictor files up to this size are hashed whole (else size + mtime)


@dataclass
class CachedParts:
    """What a cache hit hands the Engine: the description and arrays of the step, and the engine facts."""
    description: dict
    arrays: dict[str, np.ndarray]
    engine: dict  # config, model_id, fingerprint, plan facts, stats template, default threads
    path: Path


def cache_applies(args: EngineArgs) -> bool:
    """Whether ``args`` can run on the fused CPU step alone (the cached path)."""
    return (args.packed and args.fused_decode and not args.layer_offload and args.expert_slots is None
            and (args.gpu_budget_bytes or 0) == 0 and os.environ.get("TANDEM_STEP_CACHE", "1") != "0")


def _sibling(args: EngineArgs, explicit: str | None, name: str) -> Path | None:
    if explicit is not None:
        return Path(explicit)
    candidate = Path(args.plan).resolve().parent / name
    return candidate if candidate.is_dir() else None


def _hash_tree(h, root: Path, suffixes: tuple[str, ...] | None, small: int) -> None:
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and "step-cache" not in p.parts
                       and "__pycache__" not in p.parts and (suffixes is None or p.suffix in suffixes))
    else:
        h.update(f"missing:{root}".encode())
        return
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root) if p != root else p.name}:{st.st_size}".encode())
        h.update(p.read_bytes() if st.st_size <= small else str(st.st_mtime_ns).encode())


def cache_key(args: EngineArgs, model_path: Path) -> str:
    """Hex fingerprint of the inputs that decide the cached bytes."""
    h = hashlib.sha256()
    st = model_path.stat()
    h.update(f"model:{model_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    if model_path.is_file():
        with open(model_path, "rb") as f:
            h.update(f.read(HEAD_HASH_BYTES))
    h.update(json.dumps({"weight_format": args.weight_format, "down_format": args.down_format,
                         "sparse": args.sparse, "plan": args.plan is not None}).encode())
    if args.plan is not None:
        for label, folder in (("plan", Path(args.plan)), ("profile", _sibling(args, args.profile, "profile")),
                              ("predictors", _sibling(args, args.predictors, "predictors"))):
            h.update(f"{label}:{folder is not None}".encode())  # an empty folder is not the folder's absence
            if folder is not None:
                _hash_tree(h, folder, None, SMALL_FILE_BYTES)
    for rel in CODE_DIRS + CODE_FILES:
        _hash_tree(h, ROOT / rel, (".py", ".c", ".h"), SMALL_FILE_BYTES)
    return h.hexdigest()


def cache_path(args: EngineArgs, model_path: Path) -> Path:
    """Where the cache file for ``args`` lives (one file per model and packing arguments; beside the plan
    its name does not depend on the plan's path, so a copied plan folder keeps its cache)."""
    packing = [model_path.name, args.weight_format, args.down_format, args.sparse]
    if args.plan is not None and (Path(args.plan) / "plan.json").is_file():  # (never a folder in one that is no plan)
        folder = Path(args.plan) / "step-cache"
        try:
            folder.mkdir(exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder / f"step-{_short_hash(packing)}.safetensors"
        except OSError:
            pass
    where = [str(model_path.resolve()), str(Path(args.plan).resolve()) if args.plan else None]
    return shared_steps_dir() / f"step-{_short_hash(packing + where)}.safetensors"


def shared_steps_dir() -> Path:
    """The folder for caches that have no plan folder to live in: ``$TANDEM_STEP_CACHE_DIR``, else
    ``<tandem cache>/steps``. It is kept under ``shared_cap_bytes()`` (least recently used go first)."""
    if os.environ.get("TANDEM_STEP_CACHE_DIR"):
        return Path(os.environ["TANDEM_STEP_CACHE_DIR"])
    from .kernels.native import cache_dir
    return cache_dir() / "steps"


def shared_cap_bytes() -> int:
    """``$TANDEM_STEP_CACHE_BYTES`` (default 4 GiB): the shared folder's size bound."""
    value = os.environ.get("TANDEM_STEP_CACHE_BYTES", str(SHARED_CAP_BYTES))
    try:
        return max(int(value), 0)
    except ValueError:
        raise TandemError(f"TANDEM_STEP_CACHE_BYTES must be a byte count, got {value!r}") from None


def evict_shared(keep: Path) -> list[Path]:
    """Remove the least recently used caches of the shared folder beyond its cap (never ``keep``, the
    file just written or read); returns the removed paths."""
    folder, cap = keep.parent, shared_cap_bytes()
    if folder != shared_steps_dir():
        return []  # caches beside a plan: one per packing, replaced in place
    files = []
    for p in folder.glob("step-*.safetensors"):
        try:
            st = p.stat()
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, p))
    removed, total = [], 0
    for _, size, p in sorted(files, key=lambda f: f[0], reverse=True):  # newest first
        total += size
        if total > cap and p != keep:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _short_hash(values: list) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16]


def load_cached(args: EngineArgs) -> CachedParts | None:
    """The cache for ``args`` when it exists and its key matches; None otherwise (a corrupt file: warning)."""
    from tandem.core.loading.resolve import resolve_model_path
    from .execution.step_cache import StepCacheError, read_cache
    model_path = resolve_model_path(args.model)
    path = cache_path(args, model_path)
    if not path.is_file():
        return None
    try:
        description, arrays = read_cache(path)
        engine = description.get("engine") if isinstance(description, dict) else None
        if not isinstance(engine, dict) or not isinstance(description.get("step"), dict):
            raise StepCacheError(f"{path} has a corrupt description")
    except StepCacheError as exc:
        print(f"warning: step cache unusable, rebuilding it: {exc}", file=sys.stderr)
        return None
    if engine.get("key") != cache_key(args, model_path):
        return None  # stale: the model, plan, arguments or code changed
    try:
        os.utime(path)  # recently used: the shared folder evicts by modification time
    except OSError:
        pass
    return CachedParts(description["step"], arrays, engine, path)


def save_cached(engine: Any, args: EngineArgs) -> Path | None:
    """Write the cache for a freshly loaded engine whose decode path is the fused step; the path,
    or None when there is nothing to cache or the file cannot be written (the engine runs as it is)."""
    step = engine.compiled_decode
    if step is None or engine.decode_path != "fused" or not cache_applies(args):
        return None
    from tandem.core.loading.tokenizer_state import tokenizer_to_bytes
    from .execution.step_cache import StepCacheError, describe_step, write_cache
    model_path = Path(engine.model_path)
    try:
        step_desc, arrays = describe_step(step)
    except StepCacheError:
        return None
    executor = engine.executor
    zero = {k: 0 for k in executor.counters_snapshot()}
    facts = {"key": cache_key(args, model_path), "config": engine.config.to_dict(), "model_path": str(model_path),
             "model_id": engine.model_id, "model_fingerprint": engine.model_fingerprint,
             "plan_dir": str(engine.plan_info.plan_dir) if engine.plan_info is not None else None,
             "weight_bytes_per_token": engine.weight_bytes_per_token,
             "run_stats": executor.run_stats(zero, steps=1, forward_steps=1, elapsed_s=1.0),
             "threads": int(executor.settings.threads), "plan_warning": _plan_warning(args)}
    extra = {}
    if engine.tokenizer is not None:
        extra["tokenizer"] = np.frombuffer(tokenizer_to_bytes(engine.tokenizer), dtype=np.uint8)
    path = cache_path(args, model_path)
    try:
        write_cache(path, {"step": step_desc, "engine": facts}, arrays, extra)
        evict_shared(path)
    except (OSError, TandemError) as exc:
        print(f"warning: cannot write the step cache {path}: {exc}", file=sys.stderr)
        return None
    return path


def _plan_warning(args: EngineArgs) -> str | None:
    """The plan's quality warning (printed by every load, the cached one included)."""
    if args.plan is None:
        return None
    from placement.plan import read_plan
    from placement.quality import quality_warning
    return quality_warning(read_plan(Path(args.plan)).quality)
