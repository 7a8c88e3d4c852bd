"""The runtime's executors (hybrid, layer offload, GPU tier, the fused C step). The executor contract and
DenseExecutor, the exact reference they all match, live on the ground floor in tandem.core.ffn."""
