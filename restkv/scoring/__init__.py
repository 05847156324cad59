"""What scorers compute with, on tensors: window attention and its group reduction and pooling, the
observation queries (window or reconstruction), temporal weights, adaptive pooling, output-space norms,
RoPE undone and turned, and the shared ranking and top-k selection."""
