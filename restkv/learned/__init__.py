"""The trained parts' models and weights files: IndexMem's indexer and latent memory, the learned
scorer's linear maps and KVzap's surrogates (with the weights shipped for the embedded model), and the
generated text they are trained on (which DuoAttention's on-the-fly head scores read too)."""
