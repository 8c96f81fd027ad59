"""Decomposer: traces a model with torch.fx / torch.export, cuts it into layers, relays skip tensors, generates per-layer code."""
