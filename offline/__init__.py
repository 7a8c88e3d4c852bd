"""Offline stage: profile neuron activity, thresholds and MoE routing of a model."""
