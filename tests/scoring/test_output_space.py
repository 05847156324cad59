"""Output-space factors: ``R_h`` with ``R_hT R_h = W_o^hT W_o^h``, so ``||R_h x|| = ||W_o^h x||``."""

from types import SimpleNamespace

import pytest
import torch

from restkv.scoring.output_space import head_factors, head_grams


def _layer(hidden: int, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(hidden)
    return SimpleNamespace(o_proj_weight=torch.randn(hidden, heads * dim, generator=generator),
                           query=torch.zeros(1, heads, 3, dim), num_kv_heads=kv_heads)


@pytest.mark.parametrize("hidden", [32, 5], ids=["full-rank", "rank-deficient"])
def test_head_factors_reproduce_each_heads_output_norms(hidden):
    """A full-rank head gets its Gram matrix's Cholesky factor; a head whose ``W_o^h`` has fewer rows than
    its dimension (a singular Gram matrix) the QR route's, and both give ``||W_o^h x||`` for any ``x``."""
    layer = _layer(hidden)
    factors, grams = head_factors(layer), head_grams(layer)
    torch.testing.assert_close(factors.transpose(-1, -2) @ factors, grams, rtol=1e-4, atol=1e-4)
    weight = layer.o_proj_weight.view(hidden, 4, 8)  # [D, H, d]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    direct = torch.einsum("chd,hd->hc", weight, x).norm(dim=-1)
    through_factors = torch.einsum("hij,hj->hi", factors.reshape(4, 8, 8), x).norm(dim=-1)
    torch.testing.assert_close(through_factors, direct, rtol=1e-4, atol=1e-4)
