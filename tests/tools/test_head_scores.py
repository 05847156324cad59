"""The HeadKV score command (python -m restkv.files.head_scores) on a tiny model, its probes and
scoring rule, and the score file shipped for the embedded SmolLM2."""

import json
from pathlib import Path

import pytest
import torch
from test_command_lines import one_line_error
from tiny_models import tiny_model

from restkv import compress_kv
from restkv.allocations.headkv import headkv_table
from restkv.benchmarks.longbench_metrics import qa_f1_score
from restkv.files.head_scores import load_head_scores
from restkv.integrations.transformers.models import load_tokenizer
from restkv.tools.head_scores import NEEDLES, build_probe, main, probe_head_scores

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "heads_score" / "smollm2-135m_retrieval_reasoning_heads.json"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def eager_tiny(tokenizer):
    """A tiny random Llama over SmolLM2's vocabulary, with eager attention (weights needed)."""
    return tiny_model("llama", "eager", vocab_size=len(tokenizer))


def test_probe_places_the_needle_at_the_requested_depth(tokenizer):
    needle = NEEDLES[1]
    for depth in (0, 50, 100):
        probe = build_probe(tokenizer, needle, 300, depth)
        ids = probe.input_ids[0]
        assert tokenizer.decode(ids[probe.needle_start : probe.needle_end]).strip() == needle.text
        assert 280 <= ids.shape[0] <= 420  # about the requested context plus template and question
        text = tokenizer.decode(ids)
        assert text.endswith(needle.answer_prefix) and needle.question in text
        relative = probe.needle_start / ids.shape[0]
        assert {0: relative < 0.2, 50: 0.3 < relative < 0.7, 100: relative > 0.6}[depth]
    again = build_probe(tokenizer, needle, 300, 50)
    assert torch.equal(again.input_ids, build_probe(tokenizer, needle, 300, 50).input_ids)  # seeded haystack


def test_probe_answers_are_judged_by_squad_qa_f1_score():
    assert qa_f1_score("a blue flowerpot", "under a blue flowerpot") == pytest.approx(2 * 1.0 * (2 / 3) / (1 + 2 / 3))
    assert qa_f1_score("The answer is 4172.", "4172") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert qa_f1_score("Sunday", "Monday") == 0.0


@torch.no_grad()
def test_probe_scores_equal_the_rule_recomputed_from_a_full_forward(eager_tiny, tokenizer):
    """Cached greedy decoding with per-step attention equals one full forward over prompt +
    answer: each step's query row, its top-n keys (n = needle tokens), the needle's share
    10 * w / (n * answer_tokens)."""
    probe = build_probe(tokenizer, NEEDLES[0], 80, 50)
    scores, generated = probe_head_scores(eager_tiny, tokenizer, probe, max_new_tokens=4)
    assert 1 <= len(generated) <= 4
    prompt = probe.input_ids[0].tolist()
    full = torch.tensor([prompt + generated[:-1]])
    attentions = eager_tiny(full, output_attentions=True).attentions
    span = probe.needle_end - probe.needle_start
    answer_tokens = len(tokenizer(" a blue flowerpot", add_special_tokens=False)["input_ids"])
    expected = torch.zeros_like(scores)
    for step in range(len(generated)):
        row = len(prompt) - 1 + step
        for layer, weights in enumerate(attentions):
            for head in range(weights.shape[1]):
                values, positions = weights[0, head, row, : row + 1].topk(span)
                for value, position in zip(values.tolist(), positions.tolist()):
                    if probe.needle_start <= position < probe.needle_end:
                        expected[layer, head] += 10 * value / (span * answer_tokens)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)
    assert float(scores.sum()) > 0


def test_probe_scores_need_eager_attention(tokenizer):
    with pytest.raises(ValueError, match="eager"):
        probe_head_scores(tiny_model("llama", "sdpa", vocab_size=len(tokenizer)), tokenizer,
                          build_probe(tokenizer, NEEDLES[0], 60, 0))


def test_command_writes_a_loadable_score_file_for_a_tiny_model(eager_tiny, tokenizer, tmp_path):
    folder = tmp_path / "tiny"
    eager_tiny.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "heads_score" / "tiny_retrieval_reasoning_heads.json"
    args = ["--model_path", str(folder), "--out", str(out), "--context_lengths", "60", "--depths", "0", "100",
            "--num_needles", "2", "--max_new_tokens", "3"]
    message = one_line_error(lambda: main(args))  # a random model answers nothing right; only correct probes count
    assert message.startswith("error: no probe was answered correctly") and not out.exists()
    assert main(args + ["--include_failed"]) == out
    text = out.read_text()
    assert text.count("\n") == 1
    entries = json.loads(text)
    assert list(entries) == [f"{l}-{h}" for l in range(3) for h in range(4)]
    assert all(len(v) == 4 for v in entries.values())  # 2 needles x 1 length x 2 depths
    means = load_head_scores(out, 3, 4)
    assert float(means.sum()) > 0
    query = torch.randn(1, 4, 100, 16)
    key, value = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    kept = compress_kv(query, key, value, dict(method="headkv", head_scores=str(out), max_capacity_prompts=24,
                                               window_size=8), layer_idx=0, num_layers=3)
    assert kept.indices.shape[:2] == (1, 2)


def test_command_rejects_bad_grids(tmp_path):
    with pytest.raises(SystemExit):
        main(["--model_path", "smollm2-135m", "--depths", "120"])
    with pytest.raises(SystemExit):
        main(["--model_path", "smollm2-135m", "--num_needles", "0"])
    with pytest.raises(SystemExit) as stop:  # a traceback of transformers' before
        main(["--model_path", str(tmp_path / "no-model")])
    assert stop.value.code == (f"error: --model_path {tmp_path / 'no-model'}: no such folder; give a local model folder, "
                               "a hub id (org/name) or an embedded model (smollm2-135m, gemma3-270m)")


def test_shipped_smollm2_file_covers_every_query_head_and_allocates_exactly():
    entries = json.loads(SHIPPED.read_text())
    assert list(entries) == [f"{l}-{h}" for l in range(30) for h in range(9)]
    means = load_head_scores(SHIPPED, 30, 9)
    assert float((means > 0).float().mean()) > 0.5
    capacities = torch.tensor(headkv_table(str(SHIPPED), 0.0, 96, 4000, 30, 9, 3, 1.01, 1.0))
    assert int(capacities.sum()) == 30 * 3 * 96 and int(capacities.min()) >= 1


@pytest.mark.parametrize("flags, message", [
    # a ValueError traceback after the flags were read (R6)
    (["--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
    # no step decoded: the command wrote a file of zeros and said the probes were counted (R7)
    (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1 (each decoded step scores the heads); got 0"),
    (["--out", "{tmp}"], "--out {tmp}: a folder; give a file path"),
])
def test_bad_flags_are_refused_before_the_model_loads(flags, message, no_model_loading, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--model_path", "smollm2-135m", *(flag.format(tmp=tmp_path) for flag in flags)])
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_scores_that_are_all_zero_are_not_written(eager_tiny, tokenizer, tmp_path, monkeypatch):
    """A score file of zeros is one ``--head_scores`` refuses: the command says why instead of writing it."""
    import restkv.tools.head_scores as command

    folder = tmp_path / "tiny"
    eager_tiny.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    scored = command.probe_head_scores
    monkeypatch.setattr(command, "probe_head_scores",
                        lambda *args: (torch.zeros_like(scored(*args)[0]), scored(*args)[1]))
    out = tmp_path / "scores.json"
    message = one_line_error(lambda: main(["--model_path", str(folder), "--out", str(out), "--context_lengths", "60",
                                           "--depths", "0", "--num_needles", "1", "--max_new_tokens", "2",
                                           "--include_failed"]))
    assert message.startswith("error: every head scored 0 over the 1 counted probes") and not out.exists()
