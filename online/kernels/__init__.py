"""Fast CPU kernels for quantized and sparse decoding.

- ``quantize``: packed weight formats (fp32, fp16, int8 per row, int8 Q8_0 blocks, int4 groups) and
  exact conversions from GGUF blocks.
- ``cpu_kernels``: the module path's C kernels (GEMV over listed rows, sparse down projection,
  fused FFN; float activations), in ``native/module.h``.
- ``ffn``: the torch-facing ``QuantizedLinear`` and ``QuantizedFFN``.
- ``native``: the C decode step (whole model, one call per token), built on first use.

Example::

    from online.kernels import QuantizedFFN, QuantizedLinear
    ffn = QuantizedFFN.from_float(up=U, down=D, gate=G, fmt="int8", threads=2)
    y, active = ffn.forward_sparse(x, threshold=0.05)      # x: float32 [T, d]
"""
from importlib import import_module

# Imported on first use: the torch-free generate path loads online.kernels.native without torch or numba.
_EXPORTS = {"ffn": ("KERNEL_MAX_TOKENS", "QuantizedFFN", "QuantizedLinear", "kernel_max_tokens"),
            "quantize": ("FORMATS", "BlockInt8Weight", "Fp16Weight", "Fp32Weight", "Int4Weight", "Int8Weight", "Weight",
                         "concat_rows", "int4_from_q4_0", "int4_from_q4_1", "int8_from_q8_0",
                         "quantize_int4", "quantize_int8", "weight_from_gguf")}
__all__ = [name for names in _EXPORTS.values() for name in names]


def __getattr__(name: str):
    for module, names in _EXPORTS.items():
        if name in names:
            return getattr(import_module(f".{module}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
