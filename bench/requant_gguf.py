"""Re-quantize a GGUF's Q4_0 / Q4_1 tensors to Q8_0 (benchmark input: a Q8_0 file of the same model, for the
formats people download; every other tensor and all metadata are copied as they are), or to Q5_0
(``--qtype Q5_0``; ``--only exps``: only tensors whose name holds that, e.g. a MoE file's experts).

    python -m bench.requant_gguf models/SmolLM2-135M-Instruct.Q4_1.gguf models/SmolLM2-135M-Instruct.Q8_0.gguf

The Q8_0 weights are the Q4 weights dequantized and quantized again (not the original float weights), so the
file's quality is the Q4 file's; its speed is a Q8_0 model's. The output is written to a temporary file and
renamed.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

FILE_TYPES = {"Q8_0": 7, "Q5_0": 8}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def requantize(src: Path, dst: Path, qtype: str = "Q8_0", only: str = "") -> int:
    """Write ``dst`` (Q4_0 / Q4_1 tensors whose name contains ``only`` in ``qtype``); returns how many changed."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    Q = gguf.GGMLQuantizationType
    if not any(t.tensor_type in (Q.Q4_0, Q.Q4_1) for t in reader.tensors):
        raise ValueError(f"{src} has no Q4_0 / Q4_1 tensors to re-quantize")
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dst.with_name(dst.name + ".partial")
    try:
        if qtype not in FILE_TYPES:
            raise ValueError(f"unknown target type {qtype!r} (choose from {', '.join(FILE_TYPES)})")
        changed = _write(reader, gguf.GGUFWriter(str(tmp), arch), getattr(Q, qtype), FILE_TYPES[qtype], only)
        if not changed:  # (no copy of the file left behind)
            raise ValueError(f"no Q4_0 / Q4_1 tensor of {src} has {only!r} in its name")
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return changed


def _write(reader, writer, target, file_type: int, only: str) -> int:
    import gguf
    from gguf.quants import dequantize, quantize

    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = file_type if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    Q = gguf.GGMLQuantizationType
    tensors, changed = [], 0
    for t in reader.tensors:
        data, qtype = t.data, t.tensor_type
        if qtype in (Q.Q4_0, Q.Q4_1) and only in t.name:
            floats = dequantize(data, qtype)  # [rows, cols] float32
            data, qtype = quantize(floats, target), target
            changed += 1
        tensors.append((t.name, data, qtype))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--qtype", default="Q8_0", help="Q8_0 (default) or Q5_0")
    ap.add_argument("--only", default="", help="only tensors whose name contains this")
    args = ap.parse_args()
    try:
        if not args.src.is_file():
            raise ValueError(f"{args.src} is not a file")
        if not args.dst.parent.is_dir():
            raise ValueError(f"{args.dst.parent} is not a folder")
        n = requantize(args.src, args.dst, args.qtype, args.only)
    except (OSError, ValueError, KeyError) as exc:  # not a GGUF, a truncated one, a disk error: one line
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{args.dst}: {n} tensors re-quantized to {args.qtype}")


if __name__ == "__main__":
    main()
