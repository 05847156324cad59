"""Where restkv meets an inference stack: transformers (patching, the attention seam, generation)."""
