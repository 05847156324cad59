"""Query-agnostic compression that keeps the answer: reconstruction observation, KVzip, one
context for many questions (restkv.integrations.transformers.deferred, restkv.scoring.observation, restkv.policies.kvzip)."""

import copy
import math
import re
from unittest import mock

import pytest
import torch
from tiny_models import assert_patch_reproduces_unpatched, greedy, random_prompt, random_qkv, replace_for, tiny_model
from tokenizers.processors import TemplateProcessing
from toy_benchmark import toy_samples

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.benchmarks.prompts import encode_prompt
from restkv.cache import CompressedLayer, kept_positions
from restkv.cache.segments.exact import joined_view
from restkv.integrations.transformers.compat import CACHE_ARGUMENT
from restkv.integrations.transformers.generation import answer_many, generate_after_context, prefill
from restkv.integrations.transformers.handles import model_state
from restkv.integrations.transformers.reconstruction_prompt import ReconstructionPrompt, set_reconstruction_prompt
from restkv.pipeline.compress import compress_layer
from restkv.pipeline.inputs import LayerFacts, LayerInputs
from restkv.pipeline.plan import plan_layer
from restkv.scoring.observation import ReconstructionObservation, ReconstructionStats
from restkv.scoring.window import window_attention

pytestmark = pytest.mark.filterwarnings("ignore:restkv. --observation reconstruction without")


class FakeTokenizer:
    """Just enough of a tokenizer for set_reconstruction_prompt (no chat template)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [3 + (ord(c) % 200) for c in text]})()


#: a chat template with a BOS and a default system prompt, as Llama 3's and SmolLM2's have
TINY_TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a test."
                 "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
OPENING = "<|endoftext|><|im_start|>system\nYou are a test.<|im_end|>\n<|im_start|>user\n"
INSTRUCTION = "\n\nRepeat the previous context exactly."
CONTINUATION = "\n\nRepeat the part of the previous context exactly, starting with "


def with_template(tokenizer, template):
    """A copy of SmolLM2's tokenizer with ``template``, whose BOS is ``<|endoftext|>`` and added
    before every text it tokenises with special tokens."""
    changed = copy.deepcopy(tokenizer)
    changed.chat_template, changed.bos_token = template, "<|endoftext|>"
    changed._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                           special_tokens=[("<|endoftext|>", changed.bos_token_id)])
    return changed


def test_the_reconstruction_continues_the_user_turn_that_holds_the_context(tokenizer):
    """KVzip's reference: the prefill (opening, then the context), then the instruction in the
    same user turn, the template's closing and the context alone: no second system prompt, BOS or
    opening. The prompt's builder says where the context lies (query-aware: before the question)."""
    chat = with_template(tokenizer, TINY_TEMPLATE)
    model = tiny_model("llama")
    prompt = set_reconstruction_prompt(model, chat)
    prefix = prompt.before(None)
    assert chat.decode(prefix) == INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n"
    previous = torch.tensor(chat("one two three four five six seven eight nine ten", add_special_tokens=False).input_ids)
    assert chat.decode(prompt.before(previous)) == (CONTINUATION + chat.decode(previous[-8:])
                                                    + "<|im_end|>\n<|im_start|>assistant\n")
    sample = toy_samples(None, "logs", None)[0]
    for split in (True, False):
        encoded = encode_prompt(chat, sample, max_tokens=4000, split=split)
        start, stop = encoded.context_span
        assert chat.decode(encoded.context_ids[:start]) == OPENING
        assert chat.decode(encoded.context_ids[start:stop]) == sample.context
        assert chat.decode(encoded.context_ids[stop:]) == ("" if split else sample.question + "<|im_end|>\n"
                                                           "<|im_start|>assistant\n")
        repeated = prefix.tolist() + encoded.context_ids[start:stop]
        assert chat.decode(encoded.context_ids[:stop] + repeated) == (
            OPENING + sample.context + INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n" + sample.context)


def test_each_reconstruction_prompt_form_puts_its_piece_before_every_chunk(tokenizer):
    """--reconstruction_prompt: none repeats right after the context, closing after the template's closing,
    user_turn after the user turn is closed and opened again as the template began it (system prompt, user
    header; no second BOS where the tokenizer adds its own); a later chunk gets the same piece."""
    chat = with_template(tokenizer, TINY_TEMPLATE)
    prompt = set_reconstruction_prompt(tiny_model("llama"), chat)
    previous = torch.tensor(chat("one two three four five six seven eight nine ten", add_special_tokens=False).input_ids)
    expected = {"none": "", "closing": "<|im_end|>\n<|im_start|>assistant\n",
                "user_turn": "<|im_end|>\n" + OPENING.removeprefix("<|endoftext|>")}
    for form, text in expected.items():
        assert chat.decode(prompt.before(None, form)) == text
        assert chat.decode(prompt.before(previous, form)) == text
    plain = set_reconstruction_prompt(tiny_model("llama"), with_template(tokenizer, None))
    assert plain.before(None, "user_turn").tolist() == with_template(tokenizer, None)("\n\n").input_ids[1:]


@pytest.mark.parametrize("form, length", [("instruction", 3), ("none", 0), ("closing", 1), ("user_turn", 2)])
def test_the_reconstruction_reads_the_form_the_config_names(form, length):
    model = tiny_model("llama")
    repeated = []

    def count_repeated(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] < 90:
            repeated.append(hidden.shape[1])

    model.model.layers[0].register_forward_pre_hook(count_repeated, with_kwargs=True)
    model_state(model.model).reconstruction_prompt = ReconstructionPrompt(
        torch.tensor([5, 6]), torch.tensor([8]), torch.tensor([7]), torch.tensor([9, 10]))
    replace_for("llama")(method="kvzip", max_capacity_prompts=30, reconstruction_prompt=form)
    prefill(model, random_prompt(1, 90), context_span=(10, 80))
    assert repeated == [length + 70]


def test_without_a_chat_template_the_reconstruction_uses_kvzips_plain_closing(tokenizer):
    plain = with_template(tokenizer, None)
    prefix = set_reconstruction_prompt(tiny_model("llama"), plain).before(None)
    assert plain.decode(prefix) == INSTRUCTION + "\n\nAnswer: "
    sample = toy_samples(None, "logs", None)[0]
    for split in (True, False):
        encoded = encode_prompt(plain, sample, max_tokens=4000, split=split)
        assert encoded.context_span == (1, len(plain(sample.context).input_ids))  # after the tokenizer's BOS
        assert encoded.context_ids[0] == plain.bos_token_id
        assert plain.decode(encoded.context_ids[slice(*encoded.context_span)]) == sample.context


def decoder_layer_calls(model):
    """Counts forwards through the first attention layer (prefill and reconstruction chunks)."""
    calls = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize("method", ["snapkv", "restkv", "kvzip"])
def test_a_budget_at_or_above_the_context_changes_nothing(method):
    model = tiny_model("llama")
    assert_patch_reproduces_unpatched(model, "llama", random_prompt(1, 120), method=method, max_capacity_prompts=200,
                                      window_size=8, observation="reconstruction")


@pytest.mark.parametrize("length, chunk", [(80, 32), (80, 80), (50, 2048)])
def test_reconstruction_costs_one_extra_forward_per_chunk_and_leaves_nothing_behind(length, chunk):
    model = tiny_model("llama")
    set_reconstruction_prompt(model, FakeTokenizer())
    calls = decoder_layer_calls(model)
    replace_for("llama")(method="snapkv", max_capacity_prompts=16, window_size=4, observation="reconstruction",
                         reconstruction_chunk=chunk)
    cache = prefill(model, random_prompt(1, length))
    assert len(calls) == 1 + math.ceil(length / chunk)
    for layer in cache.layers:
        assert layer.tokens_seen == length and layer.tail_length == 0  # positions: the context's own
        assert layer.kept_counts.tolist() == [[16, 16]]


def test_kvzip_scores_are_the_largest_attention_of_the_reconstruction_queries():
    """The oracle, KVzip's reference: for each 16-token chunk, the unpatched model reads the
    context, the chunk's instruction (a later one quotes the previous chunk's last 8 tokens) and
    the chunk; the repeated rows' attention, renormalised over the sinks, the context chunk and
    the repetition, gives each token of the chunk its score (query and group maximum)."""
    model = tiny_model("llama", "eager")
    prompt = set_reconstruction_prompt(model, FakeTokenizer())
    context = random_prompt(1, 40)
    sinks = 2
    expected = torch.zeros(len(model.model.layers), 2, 40)
    with torch.no_grad():
        for first in range(0, 40, 16):
            last = min(first + 16, 40)
            before = prompt.before(context[0, first - 16 : first] if first else None)
            whole = torch.cat([context, before[None], context[:, first:last]], dim=-1)
            attentions = model(whole, output_attentions=True).attentions
            columns = sorted(set(range(min(sinks, first))) | set(range(first, last)) | set(range(40, whole.shape[1])))
            for index, attention in enumerate(attentions):
                rows = attention[0, :, 40:][..., columns]
                rows = rows / rows.sum(dim=-1, keepdim=True)
                chunk = rows[..., [columns.index(c) for c in range(first, last)]]
                expected[index, :, first:last] = chunk.amax(dim=1).view(2, 2, -1).amax(dim=1)
    replace_for("llama")(method="kvzip", max_capacity_prompts=10, reconstruction_chunk=16, n_sink=sinks,
                         kvzip_layerwise=True, reconstruction_prompt="instruction")
    scores = recorded_scores(lambda: prefill(model, context))
    for index, layer_scores in scores.items():
        torch.testing.assert_close(layer_scores[0, :, sinks:], expected[index, :, sinks:], rtol=1e-5, atol=1e-6)
    assert len(scores) == len(model.model.layers)


def recorded_scores(run) -> dict:
    """Each layer's KVzip scores ``[B, H_kv, N]`` while ``run`` prefills."""
    from restkv.policies.kvzip import KVzip
    scores, original = {}, KVzip.score

    def recording(policy, ctx):
        scores[ctx.layer_idx] = result = original(policy, ctx)
        return result

    with mock.patch.object(KVzip, "score", recording):
        run()
    return scores


def test_kvzip_keeps_the_token_that_takes_all_the_reconstruction_attention():
    query, key, value = random_qkv(length=64)
    key = key * 0.05
    key[0, :, 20] = 40.0  # every reconstruction query below attends to token 20 alone
    config = CompressionConfig(method="kvzip", max_capacity_prompts=6, n_sink=4, kvzip_layerwise=True)
    plan = plan_layer(config, torch.ones(1, 64, dtype=torch.bool))
    stats = ReconstructionStats(expected=8, length=64, shift_top=[6], sample_at=torch.arange(0))
    reconstruction = torch.ones(1, 4, 8, 16)
    keys = torch.cat([key, torch.zeros(1, 2, 8, 16)], dim=2)
    weights = window_attention(reconstruction, keys, torch.ones(1, 72, dtype=torch.bool), 8, 0.25)
    stats.add(weights[..., :64], 0, reconstruction)
    ctx = LayerInputs(query, key, value, plan, LayerFacts(0.25), observation=ReconstructionObservation(stats))
    columns = joined_view(compress_layer(config, ctx).kept)[2]
    for head in range(2):
        kept = columns[0, head][columns[0, head] >= 0].tolist()
        assert 20 in kept and {0, 1, 2, 3} <= set(kept)  # the token and the sinks
    assert int((columns >= 0).sum()) == 2 * 6


def test_kvzip_ranks_every_layer_and_head_together_and_keeps_the_model_wide_total():
    model = tiny_model("llama", num_hidden_layers=4)
    replace_for("llama")(method="kvzip", max_capacity_prompts=12, reconstruction_chunk=32)
    cache = prefill(model, random_prompt(1, 70))
    counts = torch.stack([layer.kept_counts[0] for layer in cache.layers])  # [layers, KV heads]
    assert int(counts.sum()) == 4 * 2 * 12 and len(set(counts.flatten().tolist())) > 1
    replace_for("llama")(method="kvzip", max_capacity_prompts=12, reconstruction_chunk=32, kvzip_layerwise=True)
    layerwise = torch.stack([layer.kept_counts[0] for layer in prefill(model, random_prompt(1, 70)).layers])
    assert layerwise.sum(dim=1).tolist() == [24] * 4


def test_one_compressed_context_answers_many_questions_as_if_each_came_alone():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=20, window_size=4, observation="reconstruction",
                         reconstruction_chunk=32)
    context = random_prompt(1, 70, seed=1)
    questions = [random_prompt(1, n, seed=seed) for n, seed in ((5, 2), (9, 3), (3, 4))]
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    together = answer_many(model, context, questions, **settings)
    for question, answer in zip(questions, together):
        assert torch.equal(answer, generate_after_context(model, context, question, **settings))
    with torch.no_grad():  # the checkpoint is the compressed context itself: nothing of a question stays
        cache = prefill(model, context)
    assert all(layer.tail_length == 0 for layer in cache.layers)


def test_reconstruction_scores_follow_the_question_not_the_context_end():
    """Window observation reads the context's last queries; reconstruction reads every token's
    repetition, so the kept sets differ while the budget is the same."""
    model = tiny_model("llama")
    context = random_prompt(1, 90, seed=5)
    kept = {}
    for observation in ("window", "reconstruction"):
        replace_for("llama")(method="snapkv", max_capacity_prompts=20, window_size=4, observation=observation)
        kept[observation] = [layer.kept_columns.clone() for layer in prefill(model, context).layers]
    assert any(not torch.equal(a, b) for a, b in zip(kept["window"], kept["reconstruction"]))
    assert all(int((a >= 0).sum()) == int((b >= 0).sum()) for a, b in zip(kept["window"], kept["reconstruction"]))


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(method="l2norm", observation="reconstruction"), "--method l2norm does not score with queries"),
        (dict(method="restkv", observation="reconstruction", metric_mode="before"), "--metric_mode before"),
        (dict(method="h2o", observation="reconstruction", h2o_queries="all"),  # once blamed --allocation uniform too
         "--h2o_queries all accumulates the attention of every prompt query at once; it cannot wait for the whole "
         "prefill (--observation reconstruction)"),
        (dict(method="kvzip", allocation="adakv"), "own model_ranked allocation"),
        (dict(method="snapkv", observation="future"), "--observation 'future' is not allowed"),
        (dict(method="snapkv", reconstruction_chunk=0), "--reconstruction_chunk must be >= 1"),
        (dict(method="kvzip", n_sink=32), "--n_sink 32 must be smaller than --max_capacity_prompts 32"),
        (dict(method="kvzip", n_sink=1000, kvzip_layerwise=True), "--n_sink 1000 must be smaller"),
    ],
)
def test_bad_reconstruction_settings_name_the_flag(options, fragment):
    with pytest.raises(ConfigError) as error:
        CompressionConfig(max_capacity_prompts=32, window_size=8, **options)
    assert fragment in str(error.value)


def test_kvzip_sinks_fill_no_ratio_budget_and_every_head_keeps_them_below_one():
    """n_sink at or above a row's ratio budget once left whole layers with no token (the model-wide
    ranking gave the sinks' ties to the first layer); such a row is refused, naming --n_sink, and a
    budget above the sinks keeps every sink in every layer and head."""
    model = tiny_model("llama")
    replace_for("llama")(method="kvzip", compression_ratio=0.9, n_sink=50, reconstruction_chunk=64)
    with pytest.raises(ConfigError, match=r"a row of 200 tokens keeps 20 tokens \(--compression_ratio 0.9\), "
                                          r"which does not exceed --n_sink 50"):
        prefill(model, random_prompt(1, 200))
    for layerwise in (False, True):
        replace_for("llama")(method="kvzip", max_capacity_prompts=64, n_sink=60, kvzip_layerwise=layerwise,
                             reconstruction_chunk=64)
        for layer in prefill(model, random_prompt(1, 200)).layers:
            kept = layer.kept_columns
            assert all(set(range(60)) <= set(kept[0, head].tolist()) for head in range(kept.shape[1]))


@pytest.mark.parametrize("options, cause", [
    (dict(method="snapkv", observation="reconstruction"), "--observation reconstruction"),
    (dict(method="kvzip"), "--observation reconstruction (--method kvzip's own)"),
])
def test_reconstruction_compresses_one_prompt_at_a_time_and_says_so_before_the_prefill(options, cause):
    """A batch of 2 once ran the whole prefill before the reconstruction pass refused it."""
    model = tiny_model("llama")
    replace_for("llama")(max_capacity_prompts=16, window_size=4, **options)
    layers_run = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda module, args: layers_run.append(1))
    message = f"{cause} compresses one prompt at a time: this prefill has 2 rows; give input_ids of one row"
    for call in (lambda: prefill(model, random_prompt(2, 40)),
                 lambda: model.generate(random_prompt(2, 40), max_new_tokens=2, do_sample=False)):
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    assert not layers_run
    hook.remove()
    short = prefill(model, random_prompt(2, 12))  # within the budget: nothing to reconstruct, nothing refused
    assert short.get_seq_length() == 12


def test_compress_kv_with_a_model_wide_allocation_ranks_the_heads_of_its_one_layer():
    query, key, value = random_qkv(length=80)
    out = compress_kv(query, key, value, dict(method="kvzip", max_capacity_prompts=20, observation="window",
                                              window_size=8))
    assert int((out.indices >= 0).sum()) == 2 * 20


@pytest.mark.parametrize("options", [dict(method="snapkv", observation="reconstruction"), dict(method="kvzip")],
                         ids=["reconstruction", "kvzip"])
def test_a_left_padded_row_keeps_what_it_keeps_unpadded(options):
    """Issue 20: the repetition once included the padding, at positions after it, and its queries
    saw the padding keys, so a padded row kept other positions than the row alone."""
    model = tiny_model("llama")
    context = random_prompt(1, 70, seed=1)
    padded = torch.cat([torch.zeros(1, 10, dtype=torch.long), context], dim=-1)
    mask = (torch.arange(80) >= 10).long()[None]
    replace_for("llama")(max_capacity_prompts=20, window_size=4, reconstruction_chunk=32, **options)
    alone, with_padding = kept_positions(prefill(model, context)), kept_positions(prefill(model, padded, mask))
    assert [layer.exact for layer in with_padding] == [layer.exact for layer in alone]


@pytest.mark.parametrize("options", [dict(method="kvzip"), dict(method="snapkv", observation="reconstruction")],
                         ids=["kvzip", "reconstruction"])
def test_reconstruction_scores_and_prunes_only_the_global_layers_of_a_sliding_window_model(options):
    """Issue 19 bug 2: sliding layers were scored by their window, global ones by reconstruction,
    and both entered one model-wide ranking (the global layer kept 7-8 tokens per head, the
    sliding ones 31-34). As KVzip's reference does, sliding layers keep their window as the
    model does and the global layers alone share the budget."""
    model = tiny_model("gemma3", sliding_window=32)
    replace_for("gemma3")(max_capacity_prompts=12, window_size=4, reconstruction_chunk=32, **options)
    cache = prefill(model, random_prompt(1, 70))
    assert [isinstance(layer, CompressedLayer) for layer in cache.layers] == [False, True, False]
    assert [layer.keys.shape[2] for layer in (cache.layers[0], cache.layers[2])] == [31, 31]
    assert int(cache.layers[1].kept_counts.sum()) == 2 * 12


def test_a_context_span_keeps_the_template_around_it_and_only_the_context_is_repeated():
    """Issue 19 items 6 and 8: KVzip's reference keeps the system prompt and template opening
    whatever their score (1265 of 1800 template (layer, head) pairs were evicted on SmolLM2) and
    repeats the context alone; a query-aware prompt's question after the context is kept too."""
    model = tiny_model("llama")
    prompt = random_prompt(1, 90)
    repeated = []

    def count_repeated(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] < 90:  # a reconstruction chunk, after the 90-token prefill
            repeated.append(hidden.shape[1])

    hook = model.model.layers[0].register_forward_pre_hook(count_repeated, with_kwargs=True)
    model_state(model.model).reconstruction_prompt = ReconstructionPrompt(
        torch.tensor([5, 6]), torch.tensor([8]), torch.tensor([7]))  # as set_reconstruction_prompt sets it
    replace_for("llama")(method="kvzip", max_capacity_prompts=30, reconstruction_chunk=128,
                         reconstruction_prompt="instruction")
    cache = prefill(model, prompt, context_span=(10, 80))
    hook.remove()
    model_state(model.model).reconstruction_prompt = None
    assert repeated == [3 + 70]  # the instruction and the span alone, in one chunk
    for layer in kept_positions(cache):
        for head in layer.exact[0]:
            assert set(range(10)) | set(range(80, 90)) <= set(head)
    with pytest.raises(ConfigError, match=r"the 40 protected tokens \(the template around context_span \(20, 70\)"):
        prefill(model, prompt, context_span=(20, 70))
    with pytest.raises(ValueError, match=r"context_span \(5, 5\) must be \(start, stop\)"):
        prefill(model, prompt, context_span=(5, 5))


def test_a_context_span_changes_nothing_under_window_observation():
    model = tiny_model("llama")
    prompt = random_prompt(1, 90)
    replace_for("llama")(method="snapkv", max_capacity_prompts=30, window_size=4)
    plain, spanned = kept_positions(prefill(model, prompt)), kept_positions(prefill(model, prompt, context_span=(10, 80)))
    assert [layer.exact for layer in plain] == [layer.exact for layer in spanned]


def test_each_chunk_repeats_against_the_context_alone_and_its_scores_come_in_bounded_blocks():
    """Memory: a chunk's repetition is dropped before the next chunk (the cache never holds more
    than the context and one chunk with its instruction), and the weights a block of scores
    materialises stay under RECONSTRUCTION_BLOCK_ELEMENTS, giving the scores of one big block."""
    from restkv.integrations.transformers import deferred

    model = tiny_model("llama")
    set_reconstruction_prompt(model, FakeTokenizer())
    context = random_prompt(1, 100)
    replace_for("llama")(method="kvzip", max_capacity_prompts=20, reconstruction_chunk=24)
    whole = recorded_scores(lambda: prefill(model, context))
    held, blocks = [], []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: held.append(kwargs[CACHE_ARGUMENT].layers[0].get_seq_length()), with_kwargs=True)
    original = ReconstructionStats.add

    def measured(stats, weights, *args, **kwargs):
        blocks.append(weights.numel())
        return original(stats, weights, *args, **kwargs)

    with mock.patch.object(deferred, "RECONSTRUCTION_BLOCK_ELEMENTS", 4 * 40 * 8), \
            mock.patch.object(ReconstructionStats, "add", measured):
        blocked = recorded_scores(lambda: prefill(model, context))
    hook.remove()
    assert held[0] == 0 and set(held[1:]) == {100}  # each chunk starts from the context alone
    assert max(blocks) <= 4 * 40 * 8 and len(blocks) > len(whole) * math.ceil(100 / 24)
    for index in whole:
        torch.testing.assert_close(blocked[index], whole[index], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("options", [dict(method="kvzip"), dict(method="kvzip", reconstruction_chunk=24),
                                     dict(method="kvzip", kvzip_plus=True), dict(method="restkv_recon", window_size=8)],
                         ids=["whole context", "chunks", "weighted queries", "restkv drift"])
@pytest.mark.parametrize("family, backend", [("llama", "sdpa"), ("qwen2", "eager")])
def test_scores_read_with_the_models_attention_equal_a_second_softmax(family, backend, options):
    """On the CPU a reconstruction chunk's attention is read as partials whose log-sum-exps also normalise its
    scores (``attend_and_observe``); with that path off, the model's own kernel runs and ``observe_chunk``
    takes a softmax of its own: the same scores, kept tokens and answers."""
    from restkv.integrations.transformers import steps

    model = tiny_model(family, backend)
    set_reconstruction_prompt(model, FakeTokenizer())
    context = random_prompt(1, 100)
    replace_for(family)(max_capacity_prompts=20, **options)
    calls = []
    original = steps.attend_and_observe

    def counted(*args, **kwargs):
        calls.append(original(*args, **kwargs))
        return calls[-1]

    with mock.patch.object(steps, "attend_and_observe", counted):
        fused = recorded_scores(lambda: prefill(model, context)) if options["method"] == "kvzip" else None
        fused_cache = prefill(model, context)
    assert calls and all(output is not None for output in calls)
    with mock.patch.object(steps, "attend_and_observe", lambda *args, **kwargs: None):
        apart = recorded_scores(lambda: prefill(model, context)) if options["method"] == "kvzip" else None
        apart_cache = prefill(model, context)
    for index in fused or ():
        torch.testing.assert_close(fused[index], apart[index], rtol=1e-5, atol=1e-7)
    assert kept_positions(fused_cache) == kept_positions(apart_cache)


# ---------------------------------------------------------------- reconstruction in chunked prefill
def scores_by_chunk(run, policy_cls=None) -> list[dict]:
    """Each ranking's ``{layer: [1, H_kv, n] scores}`` while ``run`` prefills, in order (a chunked
    prefill scores each chunk once)."""
    from restkv.policies.kvzip import KVzip
    policy_cls = policy_cls or KVzip
    rankings, original = [], policy_cls.score

    def recording(policy, ctx):
        if not rankings or ctx.layer_idx in rankings[-1]:
            rankings.append({})
        rankings[-1][ctx.layer_idx] = result = original(policy, ctx)
        return result

    with mock.patch.object(policy_cls, "score", recording):
        run()
    return rankings


CHUNKED_KVZIP = dict(method="kvzip", reconstruction_chunk=32, prefill_chunk_size=32)


def test_chunked_kvzip_scores_a_chunk_as_the_single_pass_does_when_it_sees_the_same_context():
    """A budget that keeps everything until the last chunk: that chunk's reconstruction reads the
    whole uncompressed context, as the single pass's last piece does, and gets its scores."""
    model = tiny_model("llama", num_hidden_layers=3)
    set_reconstruction_prompt(model, FakeTokenizer())
    context = random_prompt(1, 96)
    replace_for("llama")(**CHUNKED_KVZIP, max_capacity_prompts=64)
    chunked = scores_by_chunk(lambda: prefill(model, context))
    replace_for("llama")(**{**CHUNKED_KVZIP, "prefill_chunk_size": None}, max_capacity_prompts=64)
    (single,) = scores_by_chunk(lambda: prefill(model, context))
    assert [sorted(ranking) for ranking in chunked] == [[0, 1, 2]] * 3
    for index, scores in chunked[-1].items():
        torch.testing.assert_close(scores, single[index][..., 64:], rtol=1e-4, atol=1e-6)


def test_chunked_kvzip_keeps_the_model_wide_top_of_each_chunks_scores():
    """The oracle: no eviction before the last chunk, so the kept set is the model-wide top
    3 x 2 x 64 of every token's score from the ranking of its own chunk (the sinks always in)."""
    model = tiny_model("llama", num_hidden_layers=3)
    set_reconstruction_prompt(model, FakeTokenizer())
    context = random_prompt(1, 96)
    replace_for("llama")(**CHUNKED_KVZIP, max_capacity_prompts=64, n_sink=2)
    holder = {}
    rankings = scores_by_chunk(lambda: holder.update(cache=prefill(model, context)))
    assert len(rankings) == 3
    every = torch.stack([torch.cat([ranking[index][0] for ranking in rankings], dim=-1) for index in range(3)])
    won = torch.zeros_like(every, dtype=torch.bool).flatten()
    won[torch.sort(every.flatten(), descending=True, stable=True).indices[: 3 * 2 * 64]] = True
    expected = won.view_as(every)
    for index, layer in enumerate(kept_positions(holder["cache"])):
        for head in range(2):
            assert layer.exact[0][head] == expected[index, head].nonzero().flatten().tolist()
            assert {0, 1} <= set(layer.exact[0][head])


def test_chunked_reconstruction_holds_at_most_budget_chunk_and_repetition_and_none_of_it_stays():
    """Peak, over the model (its allocation is model-wide): the budget, plus one prompt chunk and
    one repetition (instruction + reconstruction chunk) per layer and KV head; after the prefill,
    every layer holds its share of the budget of the prompt alone."""
    model = tiny_model("llama", num_hidden_layers=3)
    prompt = set_reconstruction_prompt(model, FakeTokenizer())
    repetition = prompt.before(torch.zeros(32, dtype=torch.long)).shape[0] + 16
    replace_for("llama")(**{**CHUNKED_KVZIP, "reconstruction_chunk": 16}, max_capacity_prompts=24)
    held = []

    def entries(module, args, kwargs, output):
        held.append(sum(int(layer.kept_counts.sum()) + 2 * layer.tail_length if isinstance(layer, CompressedLayer)
                        else 2 * layer.get_seq_length() for layer in kwargs[CACHE_ARGUMENT].layers))

    hooks = [layer.self_attn.register_forward_hook(entries, with_kwargs=True) for layer in model.model.layers]
    cache = prefill(model, random_prompt(1, 160))
    for hook in hooks:
        hook.remove()
    assert 3 * 2 * (24 + 32) < max(held) <= 3 * 2 * (24 + 32 + repetition)
    counts = torch.stack([layer.kept_counts[0] for layer in cache.layers])
    assert int(counts.sum()) == 3 * 2 * 24
    for layer in cache.layers:
        assert layer.tokens_seen == 160 and layer.tail_length == 0 and layer.token_scores is None
        assert int(layer.kept_columns.max()) < 160


@pytest.mark.parametrize("options", [
    dict(method="restkv", observation="reconstruction", allocation="model_ranked"),
    dict(method="snapkv", observation="reconstruction", allocation="adakv"),
    dict(method="kvzip", residual=True),
])
def test_reconstruction_configurations_compress_in_chunks_to_their_budget(options):
    """The window a chunk's ranking protects is the newest tokens' of that moment: it competes in
    the next chunk's ranking (it once stayed +inf, filling the budget with old windows)."""
    model = tiny_model("llama", num_hidden_layers=3)
    set_reconstruction_prompt(model, FakeTokenizer())
    replace_for("llama")(**options, max_capacity_prompts=16, window_size=4, reconstruction_chunk=32,
                         prefill_chunk_size=32)
    cache = prefill(model, random_prompt(1, 130))
    counts = torch.stack([layer.kept_counts[0] + layer.summary_slots[0] for layer in cache.layers])
    assert int(counts.sum()) == 3 * 2 * 16
    assert len(set(counts.flatten().tolist())) > 1 or options.get("allocation") is None
    kept = kept_positions(cache)
    assert all(set(range(126, 130)) <= set(head) for layer in kept for head in layer.exact[0]) or \
        options["method"] == "kvzip"
    greedy(model, random_prompt(1, 1), new_tokens=2)  # nothing left behind breaks a new prompt


def test_kvzip_plus_weights_the_largest_attention_by_hidden_and_output_norms():
    """KVzip+ with o_proj scaled by c and every hidden state of norm ~h: each score is plain KVzip's
    maximum x ||v W_o||, so scaling o_proj by 3 scales every non-sink score by 3 (the ranking is
    kvpress' kvzip_plus case, tests/policies/test_kvpress_parity.py)."""
    model = tiny_model("llama", num_hidden_layers=2)
    set_reconstruction_prompt(model, FakeTokenizer())
    context = random_prompt(1, 60)
    replace_for("llama")(method="kvzip", max_capacity_prompts=12, reconstruction_chunk=32, kvzip_plus=True)
    base = recorded_scores(lambda: prefill(model, context))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(3.0)
    scaled = recorded_scores(lambda: prefill(model, context))
    torch.testing.assert_close(scaled[0][..., 4:], 3 * base[0][..., 4:], rtol=1e-4, atol=1e-7)
    replace_for("llama")(method="kvzip", max_capacity_prompts=12, reconstruction_chunk=32)
    plain = recorded_scores(lambda: prefill(model, context))
    assert not torch.allclose(plain[0][..., 4:], base[0][..., 4:])
    assert bool((base[0][..., :4] > base[0][..., 4:].max()).all())
