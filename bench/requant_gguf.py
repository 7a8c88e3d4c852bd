"""Re-quantize a GGUF's Q4_0 / Q4_1 tensors to Q8_0 (benchmark input: a Q8_0 file of the same model, for the
formats people download; every other tensor and all metadata are copied as they are).

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

FILE_TYPE_Q8_0 = 7  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0


def requantize(src: Path, dst: Path) -> int:
    """Write ``dst``; returns the number of tensors re-quantized."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    Q = gguf.GGMLQuantizationType
    if not any(t.tensor_type in (Q.Q4_0, Q.Q4_1) for t in reader.tensors):
        raise ValueError(f"{src} has no Q4_0 / Q4_1 tensors to re-quantize")
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dst.with_name(dst.name + ".partial")
    try:
        changed = _write(reader, gguf.GGUFWriter(str(tmp), arch))
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return changed


def _write(reader, writer) -> int:
    import gguf
    from gguf.quants import dequantize, quantize

    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = FILE_TYPE_Q8_0 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    Q = gguf.GGMLQuantizationType
    tensors, changed = [], 0
    for t in reader.tensors:
        data, qtype = t.data, t.tensor_type
        if qtype in (Q.Q4_0, Q.Q4_1):
            floats = dequantize(data, qtype)  # [rows, cols] float32
            data, qtype = quantize(floats, Q.Q8_0), Q.Q8_0
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
    args = ap.parse_args()
    try:
        if not args.src.is_file():
            raise ValueError(f"{args.src} is not a file")
        if not args.dst.parent.is_dir():
            raise ValueError(f"{args.dst.parent} is not a folder")
        n = requantize(args.src, args.dst)
    except (OSError, ValueError, KeyError) as exc:  # not a GGUF, a truncated one, a disk error: one line
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{args.dst}: {n} tensors re-quantized to Q8_0")


if __name__ == "__main__":
    main()
