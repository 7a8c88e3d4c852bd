"""The GPU decode step: Triton kernels over the tier's packed weights (``kernels``), their torch
twins (``ops``), a layer stack on the tier (``stack``) and its CUDA-graph capture (``graph_step``)."""
