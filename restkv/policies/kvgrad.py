"""KVgrad (openreview.net/forum?id=cg1wTCJjjk): KVzip's reconstruction scores weighted by what the output needs.

KVzip scores a cached token by the largest attention a reconstruction query gives it. KVgrad
asks how much that attention matters for the model's output: a token's score is

    max over reconstruction queries p and the query group of  A_{p,c} ||v_c W_o^h||_2 ||dPhi/da_p||_2

where ``A_{p,c} ||v_c W_o^h||`` is what the token writes into the residual stream at ``p`` and
``||dPhi/da_p||`` how sensitive ``Phi = sum_p ||h_p||^2`` (the last decoder layer's output over
the repeated tokens) is to the attention output at ``p`` (``restkv.integrations.transformers.replay_gradients``: one
backward pass per reconstruction chunk, the cached context held constant). Everything else is
KVzip's: the reconstruction prompt and chunks (``--reconstruction_chunk``, 512 by default as in
KVgrad's reference and kvpress), the first ``--n_sink`` tokens kept, one ranking across layers
and KV heads (``--kvzip_layerwise``: per layer).

As kvpress' ``KVgradPress``. Cost: each reconstruction chunk runs forward and backward, then
forward again to fold the weighted attention (kvpress recomputes the attention instead), about
three times KVzip's reconstruction. Runs under ``torch.no_grad()``, not ``torch.inference_mode()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from restkv.config.options import ConfigError, register
from restkv.policies.kvzip import KVzip


@register("method")
@dataclass(frozen=True)
class KVgrad(KVzip):
    name = "kvgrad"
    reference = "KVgrad: openreview.net/forum?id=cg1wTCJjjk"
    weights_by_gradient = True
    default_reconstruction_chunk = 512

    def check(self, config) -> None:
        super().check(config)
        if config.run.prefill_chunk_size is not None:
            raise ConfigError(f"--method kvgrad differentiates the reconstruction through the uncompressed prefill; "
                              f"--prefill_chunk_size {config.run.prefill_chunk_size} compresses it chunk by chunk")
        if self.kvzip_plus:
            raise ConfigError("--kvzip_plus does not apply to --method kvgrad: it always weights by ||v W_o||, and "
                              "its query weights are gradient norms, not 1 / ||h||")

    @property
    def divides_by_hidden_norm(self) -> bool:
        return False

    @property
    def weighs_by_output(self) -> bool:
        return True
