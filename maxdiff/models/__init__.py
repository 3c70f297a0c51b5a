"""maxdiff models: Flax modules mirroring the diffusers / transformers PyTorch models, with loaders."""
