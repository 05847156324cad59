"""The held-out benchmark: its flags, its reading of one compressed prefill, and a small resumable run."""

import json

import pytest
import torch

from restkv.benchmarks import heldout
from restkv.benchmarks.heldout_text import held_out_samples
from restkv.benchmarks.prompts import stop_token_ids
from restkv.integrations.transformers.generation import answer_nll, generate_after_context
from restkv.integrations.transformers.patching import compression
from restkv.integrations.transformers.reconstruction_prompt import set_reconstruction_prompt

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("flags, message", [
    (["--methods", "fullkv"], "the full cache always runs first"),
    (["--methods", "snapkv", "snapkv"], "names a spec twice"),
    (["--methods", "nosuch"], "'nosuch' is not a known method"),
    (["--compression_ratios", "1.5"], "--compression_ratio must lie in the open interval"),
    (["--num_samples", "0"], "--num_samples must be >= 1"),
    (["--types", "poetry"], "invalid choice: 'poetry'"),
    (["--methods", "snapkv+reconstruction_prompt=loud"], "--reconstruction_prompt"),
])
def test_bad_flags_stop_before_any_model_loads(flags, message, no_model_loading, capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        heldout.main([*flags, "--save_dir", str(tmp_path)])
    assert message in f"{stopped.value.code}{capsys.readouterr().err}"


@pytest.mark.parametrize("query_aware", [False, True])
def test_one_prefill_gives_the_answer_nll_and_the_greedy_answer_of_the_library(tiny, tokenizer, query_aware):
    """The oracle: the NLL equals answer_nll's and the answer generate's, each of which compresses on its own."""
    set_reconstruction_prompt(tiny, tokenizer)
    sample = held_out_samples("dialogue", tokenizer, 1, 200, 0)[0]
    encoded = heldout.encode(tokenizer, sample, query_aware)
    stops = set(stop_token_ids(tiny, tokenizer))
    prompt = torch.tensor([encoded.context_ids])
    question = torch.tensor([encoded.question_ids]) if encoded.question_ids else None
    gold = torch.tensor([tokenizer(" " + sample.answer, add_special_tokens=False).input_ids])
    with compression(tiny, method="kvzip", compression_ratio=0.8):
        measured = heldout.measure(tiny, tokenizer, encoded, sample.answer, 6, stops, heldout.CLOCKS["cpu"])
        nll = answer_nll(tiny, prompt, gold, question_ids=question, context_span=encoded.context_span)
        if question is not None:
            generated = generate_after_context(tiny, prompt, question, context_span=encoded.context_span,
                                               max_new_tokens=6, do_sample=False, eos_token_id=sorted(stops))
            assert measured["prediction"] == tokenizer.decode(generated[0], skip_special_tokens=True)
    assert measured["nll"] == pytest.approx(float(nll.mean()), abs=1e-5)
    assert measured["kv_kept"] == pytest.approx(0.2, abs=0.02)
    assert measured["prompt_tokens"] == prompt.shape[-1] and measured["prefill_seconds"] > 0


def test_a_small_run_writes_as_it_goes_resumes_and_refuses_other_settings(tiny, tokenizer, tmp_path, monkeypatch,
                                                                          capsys):
    argv = ["--num_samples", "1", "--context_tokens", "150", "--methods", "snapkv", "kvzip", "--compression_ratios",
            "0.7", "--max_new_tokens", "4", "--save_dir", str(tmp_path)]
    summary = heldout.main(argv, model=tiny, tokenizer=tokenizer)
    assert [(row["method"], row["budget"]) for row in summary] == [("fullkv", "full"), ("snapkv", "30%"),
                                                                    ("kvzip", "30%")]
    assert summary[1]["x snapkv"] == 1.0 and summary[0]["kv kept"] == 1.0
    assert all(row["samples"] == "4/4" for row in summary)
    folder = tmp_path / "agnostic_150"
    records = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 4 and {record["type"] for record in records} == {"code", "records", "dialogue", "news"}
    out = capsys.readouterr().out
    assert "x snapkv" in out and "nll dialogue" in out
    assert (tmp_path / "heldout_table.csv").is_file() and (folder / "summary.csv").is_file()

    measured = []

    def not_again(*args):
        measured.append(args)
        raise RuntimeError("measured")

    monkeypatch.setattr(heldout, "measure", not_again)
    heldout.main(argv, model=tiny, tokenizer=tokenizer)  # everything is there: nothing is measured again
    assert measured == []
    respelled = [*argv[:5], "snapkv+reconstruction_prompt=none", "kvzip+reconstruction_prompt=none", *argv[7:]]
    assert heldout.main(respelled, model=tiny, tokenizer=tokenizer)[2]["nll"] == summary[2]["nll"]  # one config
    assert measured == []
    with pytest.raises(RuntimeError, match="measured"):  # another config under a spec measured before: measured anew
        heldout.main([*argv[:5], "snapkv", "kvzip+reconstruction_prompt=closing", *argv[7:]], model=tiny,
                     tokenizer=tokenizer)
    lines = (folder / "records.jsonl").read_text().splitlines()
    changed = json.loads(lines[0]) | {"sample": "another"}
    (folder / "records.jsonl").write_text("\n".join([json.dumps(changed), *lines[1:]]) + "\n")
    with pytest.raises(SystemExit, match=r"holds records of another code sample 0 \(the held-out text changed"):
        heldout.main(argv, model=tiny, tokenizer=tokenizer)
    with pytest.raises(SystemExit, match=r"holds records of other settings \(max_new_tokens: 4 -> 5\)"):
        heldout.main([*argv[:-2], "--save_dir", str(tmp_path), "--max_new_tokens", "5"], model=tiny,
                     tokenizer=tokenizer)


def test_a_budget_too_small_for_what_a_method_protects_skips_that_configuration_with_its_reason(tiny, tokenizer,
                                                                                               tmp_path, capsys):
    summary = heldout.main(["--num_samples", "1", "--context_tokens", "150", "--types", "code", "--methods", "snapkv",
                            "restkv_recon", "--compression_ratios", "0.7", "--max_new_tokens", "2", "--save_dir",
                            str(tmp_path)], model=tiny, tokenizer=tokenizer)
    assert [row["method"] for row in summary] == ["fullkv", "snapkv"]
    assert "restkv_recon at 30% kept not run: " in capsys.readouterr().out
