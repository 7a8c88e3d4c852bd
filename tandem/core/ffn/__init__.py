"""FFN / MoE executors: the model calls ``executor.forward(layer, x)``; placement plugs in here."""
from .dense import DenseExecutor
from .weights import FFNWeights, MoELayerWeights, extract_ffn_weights

__all__ = ["DenseExecutor", "FFNWeights", "MoELayerWeights", "extract_ffn_weights"]
