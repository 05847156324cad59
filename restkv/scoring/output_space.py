"""Output-space maths shared by the scorers that read ``W_o`` (ReST-KV's ``--use_wo``, LaProx, CriticalKV).

The norm of a head's contribution to the layer output, ``||W_o^h x||``, needs no ``N x hidden``
projection: with the Gram matrix ``G_h = W_o^hT W_o^h`` (``d x d``), ``||W_o^h x||^2 = xT G_h x``, or with
a square factor ``R_h`` of it (``R_hT R_h = G_h``), ``||W_o^h x|| = ||R_h x||``: one product of every value
with every head's factor, and the differences taken in the projected space (``head_factors``).
Temporaries over many key columns are bounded by ``column_chunks``.
"""

from __future__ import annotations

import torch

#: float32 elements of one chunk of the output-space norms' ``[..., columns, d]`` temporaries. On
#: the CPU a chunk that stays in cache (4 MiB) runs about three times faster than one pass over
#: every column; on an accelerator larger chunks mean fewer kernels (8192 columns of Llama-3-8B).
CPU_CHUNK_ELEMENTS = 2**20
ACCELERATOR_CHUNK_ELEMENTS = 2**25


def head_grams(ctx) -> torch.Tensor:
    """``[H_kv, G, d, d]``: ``Γ_h = W_o^hᵀ W_o^h`` of each query head, grouped by KV head."""
    weight = output_weight(ctx)
    per_head = torch.einsum("chd,che->hde", weight, weight)
    return per_head.view(ctx.num_kv_heads, -1, *per_head.shape[1:])


def head_factors(ctx) -> torch.Tensor:
    """``[H_kv, G, d, d]``: a square ``R_h`` with ``R_hT R_h = Γ_h`` for each query head (so
    ``‖W_o^h x‖ = ‖R_h x‖``): the Cholesky factor of the Gram matrix, or where one is singular (a
    head whose ``W_o^h`` has rank below ``d``) the triangular factor of ``W_o^h``'s QR."""
    grams = head_grams(ctx)
    lower, info = torch.linalg.cholesky_ex(grams)
    if bool((info != 0).any()):
        weight = output_weight(ctx)  # [D, H, d]
        triangular = torch.linalg.qr(weight.permute(1, 0, 2), mode="r").R  # [H, min(D, d), d]
        rows = grams.shape[-1] - triangular.shape[-2]  # a W_o^h of fewer rows than d: zero rows to square it
        return torch.nn.functional.pad(triangular, (0, 0, 0, rows)).view_as(grams)
    return lower.transpose(-1, -2)


def group_grams(ctx) -> torch.Tensor:
    """``[H_kv, G*d, G*d]``: the Gram matrix of each query group's columns of ``W_o``."""
    weight = output_weight(ctx)
    grouped = weight.reshape(weight.shape[0], ctx.num_kv_heads, -1)
    return torch.einsum("ckx,cky->kxy", grouped, grouped)


def output_weight(ctx) -> torch.Tensor:
    """``o_proj.weight`` as ``[D, H, d]`` float32, checked against the query heads."""
    weight = ctx.o_proj_weight
    num_heads, head_dim = ctx.query.shape[1], ctx.query.shape[-1]
    if weight is None:
        raise ValueError(
            "scoring in output space (ReST-KV's --use_wo, LaProx, --critical) needs the layer's output projection: pass "
            "o_proj_weight ([hidden, heads * head_dim]) to compress_kv (or, for ReST-KV, use --no-use_wo)"
        )
    if weight.dim() != 2 or weight.shape[1] != num_heads * head_dim:
        raise ValueError(
            f"o_proj_weight must have shape [hidden, heads * head_dim] = [D, {num_heads * head_dim}]; "
            f"got {list(weight.shape)}"
        )
    return weight.float().view(weight.shape[0], num_heads, head_dim)


def column_chunks(length: int, per_column: int, device: torch.device) -> list[slice]:
    """Key columns in chunks whose temporaries (``per_column`` elements each column) stay within
    the device's chunk size."""
    budget = CPU_CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    step = max(1, budget // per_column)
    return [slice(start, min(start + step, length)) for start in range(0, length, step)]
