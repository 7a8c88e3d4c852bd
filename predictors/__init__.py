"""Activation predictors (issue 4): train with ``tandem train-predictors``, load with ``load_predictors``.

Example::

    from predictors import load_predictors
    pset = load_predictors("profiles/<model-id>/predictors", expected_model_fingerprint=engine.model_fingerprint)
    pset.mode(layer)                    # "predictor" | "gate" | "exact"
    pset.active_indices(layer, x)       # mode "predictor": neuron ids predicted active for x [T, d]
"""
from importlib import import_module

_HOMES = {"LayerEntry": ".model", "LayerPredictor": ".model", "PredictorSet": ".model",
          "load_predictors": ".artifact", "save_predictors": ".artifact"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    """Import on first use: the CLI registers ``train-predictors`` without loading torch."""
    if name in _HOMES:
        return getattr(import_module(_HOMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
