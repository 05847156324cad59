"""How much the model's last hidden states depend on each reconstruction query: KVgrad's gradient norms.

KVgrad (``--method kvgrad``) weights a reconstruction query's attention by ``||dPhi/da_p||``, the
norm of the gradient of ``Phi = sum_p ||h_p||^2`` (the last decoder layer's output over the
repeated tokens, before the final norm) with respect to the attention output ``a_p`` each layer
writes into the residual stream at token ``p``. ``replay_gradient_norms`` runs one reconstruction
chunk with autograd on (only the chunk's own activations take part: the cached context is read as
constants) and returns those norms per layer; the chunk is then run again without autograd to
fold the weighted attention into the statistics (``restkv.integrations.transformers.deferred``).
"""

from __future__ import annotations

from typing import Callable

import torch


def replay_gradient_norms(model_forward: Callable, decoder, input_ids: torch.Tensor, **forward_kwargs
                          ) -> dict[int, torch.Tensor]:
    """Per layer index, ``[1, q]`` float32 ``||dPhi/da_p||_2`` for the ``q`` tokens of ``input_ids``
    ``[1, q]`` run through ``decoder`` (``model_forward`` its unpatched forward) with ``forward_kwargs``."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError("--method kvgrad differentiates the reconstruction: run it under torch.no_grad(), not "
                           "torch.inference_mode() (inference tensors cannot be saved for backward)")
    outputs: dict[int, torch.Tensor] = {}
    last: list[torch.Tensor] = []

    def on_attention(module, args, output):
        outputs[int(module.layer_idx)] = output[0] if isinstance(output, tuple) else output

    def on_last_layer(module, args, output):
        last.append(output[0] if isinstance(output, tuple) else output)

    hooks = [layer.self_attn.register_forward_hook(on_attention) for layer in decoder.layers]
    hooks.append(decoder.layers[-1].register_forward_hook(on_last_layer))
    try:
        with torch.enable_grad():
            embeds = decoder.embed_tokens(input_ids).detach().requires_grad_(True)
            model_forward(decoder, inputs_embeds=embeds, **forward_kwargs)
            objective = last[-1].float().square().sum()
            layers = sorted(outputs)
            grads = torch.autograd.grad(objective, [outputs[index] for index in layers], allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    return {index: (torch.zeros(outputs[index].shape[:2], device=input_ids.device) if grad is None
                    else grad.detach().float().norm(dim=-1)) for index, grad in zip(layers, grads)}
