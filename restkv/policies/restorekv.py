"""RestoreKV (arXiv 2608.01247): KVzip, plus ``n`` learned restore tokens that fill part of its budget.

After the context's prefill and KVzip's reconstruction scores, and before anything is evicted, the ``n``
restore embeddings (a trained ``[n, hidden]`` tensor, fed as input embeddings) run through the model in
one pass over the whole uncompressed context, at the positions right after it, with a low-rank adapter on
the attention projections active for that pass only (``restkv.learned.restore``). Their keys and values,
in every compressed layer, join the compressed cache as a segment of their own
(``restkv.cache.segments.restore_tokens``), and KVzip evicts to ``n`` fewer tokens per KV head (the
model-wide ranking spreads ``n`` fewer per head over the model), so the cache holds the budget: the
restore tokens fill ``n`` slots of each head's, the evictor the rest. The question and the answer are
then read by the plain model over the kept tokens and the restore tokens. The embeddings and the adapter
are trained by self-distillation from the full cache (``python -m restkv.tools.train_restore``).

``--restore_weights FILE`` names the trained weights (the number of restore tokens, the adapter's rank
and scale are the file's); without it, the weights shipped for the embedded default model
(``SmolLM2-135M``) are read, and a model of another shape is refused with the command that trains its own.

Positions: the restore tokens are encoded at the positions right after the context (``N .. N+n-1``), as
kvpress' ``RestoreKVPress`` encodes them; the tokens that follow (the question) continue at ``N``, as after
any other compression, so every caller (``generate_after_context``, ``answer_many``, the runners) is
unchanged, and the restore tokens are visible to every later query. kvpress' pipeline continues at
``N + n`` instead; the trained weights learn the positions they are used with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from restkv.cache.segments.restore_tokens import RestoreTokens
from restkv.config.options import ConfigError, option, register
from restkv.files.reading import check_shape
from restkv.learned.restore import SHIPPED_RESTORE, restore_weights_of
from restkv.policies.kvzip import KVzip


@register("method")
@dataclass(frozen=True)
class RestoreKV(KVzip):
    name = "restorekv"
    reference = "RestoreKV: arXiv 2608.01247"
    base_method = "kvzip"
    fitted_to_a_model = True
    steps_before_eviction = True

    restore_weights: str | None = option(
        None, "RestoreKV: safetensors file of the restore embeddings and the restore pass's low-rank adapter "
        "(python -m restkv.tools.train_restore); default: the ones shipped for SmolLM2-135M", names_file=True)

    def validate(self) -> None:
        super().validate()
        if self.restore_weights is not None:
            restore_weights_of(self.restore_weights)

    def file_read(self, name: str) -> str | None:
        if name == "restore_weights":
            return self.restore_weights or str(SHIPPED_RESTORE)
        return super().file_read(name)

    @property
    def restore_tokens(self) -> int:
        """The restore tokens the weights file holds: the slots of each head's budget they fill."""
        return restore_weights_of(self.file_read("restore_weights")).tokens

    def check(self, config) -> None:
        super().check(config)
        if config.run.observation != "reconstruction":
            raise ConfigError(f"--method restorekv runs its restore pass after KVzip's reconstruction; --observation "
                              f"{config.run.observation} scores without it")
        if config.run.prefill_chunk_size is not None:
            raise ConfigError(f"--method restorekv encodes its restore tokens over the whole uncompressed context; "
                              f"--prefill_chunk_size {config.run.prefill_chunk_size} compresses it chunk by chunk")
        if config.compresses_decoding:
            raise ConfigError(f"--method restorekv keeps its restore tokens as entries of their own, which a compression "
                              f"during generation ({' and '.join(config.rescoring_flags(every_method=True))}) would "
                              "not carry over: compress the prompt only")
        budget = config.run.max_capacity_prompts
        if budget is not None and not self.compressible_to(config.run.window_size, budget):
            raise ConfigError(f"--max_capacity_prompts {budget} must exceed {self.always_kept(config.run.window_size)}")

    def compressible_to(self, window_size: int, budget: int) -> bool:
        return self.n_sink + self.restore_tokens < budget

    def always_kept(self, window_size: int) -> str:
        return (f"--n_sink {self.n_sink} and the {self.restore_tokens} restore tokens of --restore_weights (the "
                "first --n_sink tokens are always kept, the restore tokens fill slots of each head's budget)")

    def check_model(self, config, model) -> None:
        path = self.file_read("restore_weights")
        weights = restore_weights_of(path)
        try:
            check_shape("--restore_weights", path, "restore_embeddings", weights.embeddings.shape,
                        (None, model.hidden_size))
            outputs = {"q_proj": model.num_heads * model.head_dim, "k_proj": model.num_kv_heads * model.head_dim,
                       "v_proj": model.num_kv_heads * model.head_dim, "o_proj": model.hidden_size}
            inputs = {**{name: model.hidden_size for name in outputs}, "o_proj": model.num_heads * model.head_dim}
            for (layer, name), (down, up) in weights.adapters.items():
                prefix = f"layers.{layer}.self_attn.{name}"
                if layer >= model.num_layers:
                    raise ConfigError(f"--restore_weights {path!r}: {prefix} adapts layer {layer}; the model has "
                                      f"{model.num_layers} layers (a file made for another model?)")
                check_shape("--restore_weights", path, f"{prefix}.lora_A.weight", down.shape, (None, inputs[name]))
                check_shape("--restore_weights", path, f"{prefix}.lora_B.weight", up.shape, (outputs[name], None))
        except ConfigError as error:
            if self.restore_weights:
                raise
            raise ConfigError(f"{error}; the shipped restore weights are SmolLM2-135M's: train weights for this "
                              "model with python -m restkv.tools.train_restore --model_path MODEL --output FILE and "
                              "give --restore_weights FILE") from None

    def before_eviction(self, decoder, layers: list[int], forward: Callable) -> dict[int, list]:
        """The restore pass: the embeddings run after the whole context with the adapter on (and off again
        after it), their K/V in each of ``layers`` a ``RestoreTokens`` segment."""
        weights = restore_weights_of(self.file_read("restore_weights"))
        reference = decoder.embed_tokens.weight
        embeddings = weights.embeddings.to(reference.device, reference.dtype)[None]
        with weights.adapted(decoder), torch.no_grad():
            states = forward(embeddings)
        return {index: [RestoreTokens(*states[index])] for index in layers}
