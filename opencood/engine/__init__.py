"""Training and evaluation engine: optimiser/schedule builders and the training loop."""
