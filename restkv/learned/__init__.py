"""The trained parts' models and weights files: IndexMem's indexer and latent memory, the learned
scorer's linear maps and KVzap's surrogates (with the weights shipped for the embedded model)."""
