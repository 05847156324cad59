"""On a CUDA GPU (marker ``cuda``; skipped elsewhere): flash_attention_2 is exact at full budget
and compresses what sdpa compresses, and every read kernel (the flash-attn one with its
log-sum-exp included) reads a compressed layer with residual entries as the eager reference
does on CUDA tensors.

Run with ``pytest -m cuda`` (``scripts/device_check.sh`` does). The flash tests also need the
``flash-attn`` package (``pip install -e .[flash]``).
"""

import importlib.util

import pytest
import torch
from tiny_models import assert_patch_reproduces_unpatched, greedy, left_padded, random_prompt, tiny_model

from restkv.cache import CompressedLayer
from restkv.cache.partial import KERNELS, Probe, use_kernel
from restkv.integrations.transformers.generation import prefill
from restkv.integrations.transformers.patching import replace_llama
from restkv.switches.residual import ResidualEntries, ResidualReadout

HAS_FLASH = importlib.util.find_spec("flash_attn") is not None

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_flash = pytest.mark.skipif(not HAS_FLASH, reason="needs the flash-attn package (pip install -e .[flash])")

DEVICE = "cuda"
#: heads of 32 dims (flash-attn takes multiples of 8), four query heads over two KV heads
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)


def cuda_llama(attn_implementation: str, dtype=torch.bfloat16, seed: int = 0, **overrides):
    """The tiny random Llama of the CPU tests, moved to the GPU in ``dtype``."""
    model = tiny_model("llama", "sdpa", seed=seed, **{**SHAPE, **overrides}).to(DEVICE, dtype)
    model.set_attn_implementation(attn_implementation)  # checks that flash-attn is usable
    return model


def on_gpu(*tensors):
    return [t if t is None else t.to(DEVICE) for t in tensors]


def kept_columns(cache) -> list[torch.Tensor]:
    """Per layer, the padded-batch columns each row and KV head kept ``[B, H_kv, K]`` (-1 unused)."""
    return [layer.kept_columns.cpu() for layer in cache.layers if isinstance(layer, CompressedLayer)]


def kept_sets(columns: torch.Tensor) -> list[list[set[int]]]:
    return [[set(c for c in head.tolist() if c >= 0) for head in row] for row in columns]


# ---------------------------------------------------------------- flash_attention_2 at full budget
@needs_flash
@pytest.mark.parametrize("batch", ["single", "left_padded_3"])
def test_flash_at_full_budget_reproduces_the_unpatched_model(batch):
    model = cuda_llama("flash_attention_2")
    if batch == "single":
        input_ids, attention_mask = random_prompt(1, 70), None
    else:
        input_ids, attention_mask = left_padded([70, 52, 31])
    input_ids, attention_mask = on_gpu(input_ids, attention_mask)
    reference = greedy(model, input_ids, attention_mask, new_tokens=6)
    replace_llama(method="snapkv", max_capacity_prompts=70, window_size=8)
    patched = greedy(model, input_ids, attention_mask, new_tokens=6)
    assert torch.equal(patched.sequences, reference.sequences)
    for ours, theirs in zip(patched.logits, reference.logits):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)  # bf16


def test_sdpa_at_full_budget_reproduces_the_unpatched_model_on_the_gpu():
    model = cuda_llama("sdpa", dtype=torch.float32)
    input_ids, attention_mask = on_gpu(*left_padded([70, 52, 31]))
    assert_patch_reproduces_unpatched(model, "llama", input_ids, attention_mask, new_tokens=6,
                                      method="snapkv", max_capacity_prompts=70, window_size=8)


# ---------------------------------------------------------------- flash compresses what sdpa compresses
def compressed_prefill(model, attn_implementation: str, input_ids, attention_mask, **options):
    model.set_attn_implementation(attn_implementation)
    replace_llama(**options)
    return prefill(model, input_ids, attention_mask)


FLASH_METHODS = [
    dict(method="snapkv"),
    dict(method="adakv"),
    dict(method="restkv", use_wo=False),  # its W_o Gram matrices are zero in the model below
    dict(method="snapkv", residual=True),
    dict(method="snapkv", quant_method="kvquant", nbits=4, quant_group_size=8, quant_residual_length=8),
    dict(method="think", recent_size=8),
]


@needs_flash
@pytest.mark.parametrize("options", FLASH_METHODS, ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
def test_flash_compresses_exactly_what_sdpa_compresses_when_layer_inputs_agree(options):
    """With zero output projections every layer sees the same inputs under both kernels (the
    attention output adds nothing to the residual stream), so the kept sets and the residual
    entries must be the same bit for bit: only the kernel that produced the (unused) output differs."""
    model = cuda_llama("sdpa")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    input_ids, attention_mask = on_gpu(*left_padded([96, 80, 61]))
    options = dict(options, max_capacity_prompts=24, window_size=8)
    sdpa = compressed_prefill(model, "sdpa", input_ids, attention_mask, **options)
    flash = compressed_prefill(model, "flash_attention_2", input_ids, attention_mask, **options)
    assert len(kept_columns(sdpa)) == len(model.model.layers)
    for ours, theirs in zip(kept_columns(flash), kept_columns(sdpa)):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(flash.layers, sdpa.layers):
        assert torch.equal(ours.kept_keys, theirs.kept_keys) and torch.equal(ours.kept_values, theirs.kept_values)
        if theirs.residual_log_counts is None:
            assert ours.residual_log_counts is None
        else:
            assert torch.equal(ours.residual_log_counts, theirs.residual_log_counts)


@needs_flash
def test_flash_kept_sets_differ_from_sdpa_only_at_bf16_ties(monkeypatch):
    """A real model: layer 0 sees identical inputs, so its kept sets are identical; deeper layers
    see hidden states that differ by the two kernels' bf16 rounding, so a token may change sides
    only where its score (in the sdpa run) is within bf16 resolution of the selection threshold."""
    import restkv.integrations.transformers.attention

    scores_by_layer: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    compress_layer = restkv.integrations.transformers.attention.compress_layer

    def recording(config, ctx, *args, **kwargs):
        scores_by_layer[ctx.layer_idx] = (config.policy.score(ctx).float().cpu(), ctx.candidates.cpu())
        return compress_layer(config, ctx, *args, **kwargs)

    model = cuda_llama("sdpa")
    input_ids, attention_mask = on_gpu(*left_padded([96, 80, 61]))
    options = dict(method="snapkv", max_capacity_prompts=24, window_size=8)
    monkeypatch.setattr(restkv.integrations.transformers.attention, "compress_layer", recording)
    sdpa = kept_columns(compressed_prefill(model, "sdpa", input_ids, attention_mask, **options))
    monkeypatch.setattr(restkv.integrations.transformers.attention, "compress_layer", compress_layer)
    flash = kept_columns(compressed_prefill(model, "flash_attention_2", input_ids, attention_mask, **options))
    assert torch.equal(flash[0], sdpa[0])
    resolution = 2.0 ** -6  # a few bf16 ulps of relative change in a score
    for layer, (ours, theirs) in enumerate(zip(flash, sdpa)):
        scores, candidates = scores_by_layer[layer]
        for row, (our_row, their_row) in enumerate(zip(kept_sets(ours), kept_sets(theirs))):
            competing = set(candidates[row].nonzero().flatten().tolist())
            for head, (our_set, their_set) in enumerate(zip(our_row, their_row)):
                changed = our_set ^ their_set
                if not changed:
                    continue
                assert changed <= competing  # protected tokens stay under both kernels
                head_scores = scores[row, head]
                threshold = head_scores[sorted(their_set & competing)].min()  # the last candidate kept
                for column in changed:
                    gap = (head_scores[column] - threshold).abs()
                    assert gap <= resolution * threshold.abs().clamp(min=1e-12), (layer, row, head, column)


# ---------------------------------------------------------------- the LSE combination on CUDA tensors
READOUTS = [ResidualReadout(), ResidualReadout(gate=False), ResidualReadout(beta=0.5, gate_min=0.2),
            ResidualReadout(separate_softmax=True)]


def residual_layer(readout, dtype=torch.float32, seed: int = 0, kv_heads: int = 2, main: int = 40, entries: int = 6,
                   dim: int = 32) -> CompressedLayer:
    """A layer of ``main`` exact tokens and ``entries`` residual entries (one slot unused), on the GPU."""
    generator = torch.Generator().manual_seed(seed)
    main_k, main_v = (torch.randn(1, kv_heads, main, dim, generator=generator).to(DEVICE, dtype) for _ in range(2))
    res_k, res_v = (torch.randn(1, kv_heads, entries, dim, generator=generator).to(DEVICE, dtype) for _ in range(2))
    log_counts = torch.rand(1, kv_heads, entries, generator=generator).mul(3).log1p()
    log_counts[0, 0, 0] = float("-inf")  # an unused slot
    columns = torch.arange(main, device=DEVICE).expand(1, kv_heads, -1)
    summary = ResidualEntries(res_k, res_v, log_counts.to(DEVICE), readout)
    return CompressedLayer.from_tokens(main_k, main_v, columns, tokens_seen=main, summaries=[summary])


@pytest.mark.parametrize("readout", READOUTS)
def test_every_kernel_reads_residual_entries_as_the_reference_does_on_cuda_tensors(readout):
    layer = residual_layer(readout)
    query = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    probe = dict(num_kv_heads=2, first_column=40, scaling=32 ** -0.5)
    with use_kernel("reference"):
        reference = layer.read(Probe(query, **probe))
    for name in KERNELS:
        if name == "flash":
            continue  # flash-attn takes half precision: the bf16 test below
        with use_kernel(name):
            torch.testing.assert_close(layer.read(Probe(query, **probe)), reference, rtol=1e-5, atol=1e-5)


@needs_flash
@pytest.mark.parametrize("readout", READOUTS)
def test_the_flash_kernel_with_its_log_sum_exp_reads_as_the_reference_in_bf16(readout):
    layer = residual_layer(readout, dtype=torch.bfloat16, seed=1)
    query = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    probe = dict(num_kv_heads=2, first_column=40, scaling=32 ** -0.5)
    with use_kernel("reference"):
        reference = layer.read(Probe(query, **probe)).float()
    with use_kernel("flash"):
        flash = layer.read(Probe(query, **probe)).float()
    torch.testing.assert_close(flash, reference, rtol=2e-2, atol=2e-2)  # bf16 kernels


# ---------------------------------------------------------------- the CPU fast paths pick what the GPU paths pick
def test_the_cpu_drift_statistic_equals_topk_on_the_gpu_ties_included():
    """On the CPU the top positions come from NumPy's partition threshold (topk only for tied
    rows), on a GPU from topk: the same sums, also for rows full of equal weights."""
    from restkv.scoring.observation import top_position_sums

    generator = torch.Generator().manual_seed(0)
    weights = torch.softmax(torch.randn(3, 8, 300, generator=generator) * 4, dim=-1)
    weights[0, :3] = 1.0 / 300  # uniform rows: every weight ties
    weights[1, 2, 100:] = 0.0  # a tie at zero below the top
    valid = torch.ones(300, dtype=torch.bool)
    valid[:20] = False
    for top in (1, 37, 150):
        cpu = top_position_sums(weights, valid, top)
        gpu = top_position_sums(weights.to(DEVICE), valid.to(DEVICE), top)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))


def test_cpu_and_gpu_kmeans_make_the_same_clusters_on_exactly_representable_points():
    """Small-integer keys make every distance exact in float32, so the nearest centre (ties to
    the lowest index: NumPy's argmin on the CPU, min on a GPU) must agree everywhere."""
    from restkv.switches.residual import lloyd_kmeans

    generator = torch.Generator().manual_seed(0)
    points = torch.randint(-4, 5, (3, 400, 16), generator=generator).float()
    members = torch.rand(3, 400, generator=generator) > 0.1
    init = torch.stack([torch.randperm(400, generator=generator)[:12] for _ in range(3)])
    init[1, 9:] = -1  # a head with fewer clusters
    cpu = lloyd_kmeans(points, members, init, 4)
    gpu = lloyd_kmeans(*on_gpu(points, members, init), 4)
    assert torch.equal(cpu.assignment, gpu.assignment.cpu()) and torch.equal(cpu.counts, gpu.counts.cpu())


@pytest.mark.parametrize("causal", [False, True])
def test_the_validation_target_equals_fused_attention_on_the_gpu(causal):
    """The full-prompt target the validation proxy reads (segments joined by log-sum-exp) equals
    one fused softmax over every key."""
    import torch.nn.functional as F

    from restkv.switches.residual import full_attention_output

    generator = torch.Generator().manual_seed(0)
    queries, keys, values = on_gpu(*(torch.randn(2, n, 32, generator=generator) for n in (24, 9000, 9000)))
    visible = None
    if causal:
        visible = (torch.arange(9000, device=DEVICE)[None, :] <= torch.arange(8976, 9000, device=DEVICE)[:, None])[None]
    ours = full_attention_output(queries, keys, values, 0.2, None, visible)
    fused = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=0.2)
    torch.testing.assert_close(ours, fused, rtol=1e-4, atol=1e-5)
