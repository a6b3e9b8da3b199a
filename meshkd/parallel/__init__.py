"""Laying a transformers causal LM out over its role's mesh, one concern per module; the model's own code runs."""
