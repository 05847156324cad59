"""The trained parts' models and weights files: IndexMem's indexer and latent memory, and the learned
scorer's linear maps (with the weights shipped for the embedded model)."""
