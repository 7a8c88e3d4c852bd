"""Activation predictors (issue 4): train with ``tandem train-predictors``, load with ``load_predictors``.

Example::

    from predictors import load_predictors
    pset = load_predictors("profiles/<model-id>/predictors", expected_model_fingerprint=engine.model_fingerprint)
    pset.mode(layer)                    # "predictor" | "gate" | "exact"
    pset.active_indices(layer, x)       # mode "predictor": neuron ids predicted active for x [T, d]
"""
from .artifact import load_predictors, save_predictors
from .model import LayerEntry, LayerPredictor, PredictorSet

__all__ = ["LayerEntry", "LayerPredictor", "PredictorSet", "load_predictors", "save_predictors"]
