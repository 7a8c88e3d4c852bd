"""Predictor descriptors for the fused decode step (online/kernels/native/predict.h).

A layer whose split has a predictor (``predictors.runtime.LayerGate``: an MLP scorer ``d -> rank ->
n_ff`` and a logit threshold) gets a ``TdmPredictor``: W1/W2 as int8 rows (or float32 when the rank
is not a multiple of 32, or on request), the biases, and its scratch. The step then reads only the
predicted rows, as the module path does (``QuantizedFFN.forward_numpy`` with the predicted ids).

Example::

    pred = build_predictor(split.predictor, threads=2)       # PredictorRef or None
    layer.pred = ctypes.pointer(pred.desc)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.core.errors import TandemError

from ..kernels.native.structs import TdmPredictor, addr, describe
from ..kernels.quantize import Fp32Weight, quantize_int8

PREDICTOR_FORMATS = ("int8", "fp32")


@dataclass
class PredictorRef:
    """A descriptor and everything it points into; ``predicted``/``computed``: per-thread row counters."""
    desc: TdmPredictor
    keep: tuple
    predicted: np.ndarray
    computed: np.ndarray


def build_predictor(gate, threads: int, lib, fmt: str = "int8") -> PredictorRef:
    if fmt not in PREDICTOR_FORMATS:
        raise TandemError(f"predictor format must be one of {', '.join(PREDICTOR_FORMATS)}, got {fmt!r}")
    module = getattr(gate, "module", None)
    if module is None:
        raise TandemError("the layer's predictor is not an MLP scorer the fused step can run")
    w1 = module.down.weight.detach().float().contiguous().numpy()  # [rank, d]
    w2 = module.up.weight.detach().float().contiguous().numpy()  # [n_ff, rank]
    b1 = module.down.bias.detach().float().contiguous().numpy()  # [rank]
    b2 = module.up.bias.detach().float().contiguous().numpy()  # [n_ff]
    rank = w1.shape[0]
    if fmt == "int8" and rank % 32 == 0 and w1.shape[1] % 32 == 0:
        r1, r2 = describe(quantize_int8(w1)), describe(quantize_int8(w2))
    else:
        r1, r2 = describe(Fp32Weight(w1)), describe(Fp32Weight(w2))
    z = np.zeros(rank, dtype=np.float32)
    scratch = np.zeros(int(lib.tdm_pred_scratch_bytes(rank, threads)), dtype=np.uint8)
    predicted, computed = np.zeros(threads, dtype=np.int64), np.zeros(threads, dtype=np.int64)
    desc = TdmPredictor(rank=rank, w1=r1.desc, w2=r2.desc, b1=addr(b1), b2=addr(b2), threshold=float(gate.threshold),
                        z=addr(z), scratch=addr(scratch), predicted=addr(predicted), computed=addr(computed))
    return PredictorRef(desc, (r1, r2, b1, b2, z, scratch), predicted, computed)
