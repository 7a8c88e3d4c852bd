"""The fused decode step as a file: its C descriptors (TdmModel, its layers, their weights and
predictors) walked field by field into JSON, and every array they point into saved as a tensor of
one safetensors file (no pickles), written atomically (temp + rename).

The walk follows the ctypes structs' own ``_fields_`` (online/kernels/native/structs.py), so fields
added to them are carried without a change here: integers and doubles as numbers, nested structs
as objects, pointers as the name of the array they point to. Pointers to per-process state (the KV
cache, scratch, counters) are not stored; ``RUNTIME_POINTERS`` lists them and NativeStep makes them
afresh. A pointer that is neither a kept array nor runtime state makes ``describe_step`` raise, so
an unknown new field cannot be cached wrong.

Reading maps the file (no copy) and checks the header's tensors against the file size, and each
weight's rows * row_bytes against its data: a truncated or corrupt file raises StepCacheError.

Example::

    description, arrays = describe_step(step)            # step: FusedDecodeStep
    write_cache(path, description, arrays, extra_arrays={"tokenizer": tok_bytes})
    description, arrays = read_cache(path)               # arrays: read-only views of the mapped file
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from tandem.core.errors import TandemError

RUNTIME_POINTERS = {"TdmModel": ("work",), "TdmLayer": ("k_cache", "v_cache"),
                    "TdmPredictor": ("z", "scratch", "predicted", "computed")}
FORMAT_VERSION = 1
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64}


class StepCacheError(TandemError):
    """The cache file cannot be used (the message says why); callers rebuild it."""


def _arrays_of(obj, out: list) -> None:
    """Every numpy array reachable from the step's kept objects (WeightRef, PredictorRef, tuples)."""
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _arrays_of(item, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _arrays_of(getattr(obj, name), out)


def describe_step(step) -> tuple[dict, dict[str, np.ndarray]]:
    """(JSON-able description of ``step._desc``, arrays by name) of a built FusedDecodeStep."""
    found: list[np.ndarray] = []
    _arrays_of(step._keep, found)
    by_addr: dict[int, np.ndarray] = {}
    for a in found:
        if a.size and (a.ctypes.data not in by_addr or a.nbytes > by_addr[a.ctypes.data].nbytes):
            by_addr[a.ctypes.data] = a
    names: dict[int, str] = {}
    arrays: dict[str, np.ndarray] = {}

    def pointer(owner: str, field: str, value) -> str | None:
        if value is None or field in RUNTIME_POINTERS.get(owner, ()):
            return None
        if value not in by_addr:
            raise StepCacheError(f"{owner}.{field} points to memory the step does not keep as an array")
        if value not in names:
            names[value] = f"a{len(names)}"
            arrays[names[value]] = np.ascontiguousarray(by_addr[value])
        return names[value]

    def walk(s: ctypes.Structure, n_layers: int) -> dict:
        owner, out = type(s).__name__, {}
        for field, ctype in s._fields_:
            value = getattr(s, field)
            if ctype is ctypes.c_void_p:
                out[field] = {"array": pointer(owner, field, value)}
            elif isinstance(ctype, type) and issubclass(ctype, ctypes.Structure):
                out[field] = walk(value, n_layers)
            elif hasattr(ctype, "_type_") and isinstance(ctype._type_, type) and issubclass(ctype._type_, ctypes.Structure):
                count = struct_count(s, field, n_layers)
                out[field] = None if not value else [walk(value[i], n_layers) for i in range(count)]
            else:
                out[field] = value
        return out

    return walk(step._desc, int(step._desc.n_layers)), arrays


def struct_count(owner: ctypes.Structure, field: str, n_layers: int) -> int:
    """How many structs a pointer field of ``owner`` points to: the model's layers, a MoE layer's
    experts, else one."""
    if field == "layers":
        return n_layers
    if field == "experts":
        return int(owner.n_experts)
    return 1


def write_cache(path: Path, description: dict, arrays: dict[str, np.ndarray],
                extra_arrays: dict[str, np.ndarray] | None = None) -> None:
    """One safetensors file: the arrays, and the description in its metadata; atomic."""
    from safetensors.numpy import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = dict(arrays) | {f"extra.{k}": v for k, v in (extra_arrays or {}).items()}
    text = json.dumps(description)
    meta = {"tandem_step_cache": str(FORMAT_VERSION), "description": text,
            "description_sha256": hashlib.sha256(text.encode()).hexdigest()}
    fd, tmp = tempfile.mkstemp(prefix=".step-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_cache(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(description, arrays) of a file ``write_cache`` wrote; arrays are read-only views of a mapping."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise StepCacheError(f"{path} is truncated")
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as exc:
        raise StepCacheError(f"cannot read {path}: {exc.strerror or exc}") from None
    (n_header,) = struct.unpack("<Q", mapped[:8])
    if n_header > size - 8:
        raise StepCacheError(f"{path} is truncated (header of {n_header} bytes)")
    try:
        header = json.loads(bytes(mapped[8:8 + n_header]))
        meta = header.pop("__metadata__")
        if meta.get("tandem_step_cache") != str(FORMAT_VERSION):
            raise StepCacheError(f"{path} is not a step cache of format {FORMAT_VERSION}")
        if hashlib.sha256(meta["description"].encode()).hexdigest() != meta["description_sha256"]:
            raise StepCacheError(f"{path} has a corrupt description (checksum)")
        description = json.loads(meta["description"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise StepCacheError(f"{path} has a corrupt header") from None
    base, arrays = 8 + n_header, {}
    for name, info in header.items():
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]])
            shape = [int(n) for n in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise StepCacheError(f"{path}: tensor {name!r} has a corrupt header entry") from None
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= size - base or end - begin != count * dtype.itemsize:
            raise StepCacheError(f"{path}: tensor {name!r} lies outside the file or has the wrong size")
        arrays[name] = np.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin).reshape(shape)
    return description, arrays
