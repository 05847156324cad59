"""restkv inside a transformers model: which models it serves (``seams``), patching (``patching``),
the attention seam (``attention``), the state kept beside transformers objects (``handles``), compression
after the whole prefill (``deferred``, ``reconstruction_prompt``, ``replay_gradients``, ``context_span``),
generation helpers (``generation``), model loading (``models``) and the supported versions (``compat``)."""
