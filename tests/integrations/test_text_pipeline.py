"""The ``restkv-text-generation`` pipeline task: prompt split, compression options, answers, refusals."""

import copy
import subprocess
import sys

import pytest
import torch
from transformers import pipeline
from transformers.pipelines import get_supported_tasks

import restkv
import restkv.integrations.transformers.text_pipeline as text_pipeline
from restkv.benchmarks.haystack import load_essays
from restkv.benchmarks.needle import build_prompts
from restkv.config import ConfigError
from restkv.integrations.transformers.text_pipeline import TASK, PipelineInputError
from restkv.policies import SnapKV

CONTEXT = ("The ferry to the island leaves at seven. Tickets are sold at the harbour office. " * 6).strip()
QUESTION = "When does the ferry leave?"
GREEDY = dict(max_new_tokens=6, do_sample=False)


@pytest.fixture(scope="module")
def pipe(tiny, tokenizer):
    return pipeline(TASK, model=tiny, tokenizer=tokenizer)


@pytest.fixture
def no_generation(monkeypatch):
    """Fails the test if the model is asked to answer: the refusal under test must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model ran before the error was found")

    monkeypatch.setattr(text_pipeline, "answer_many", refuse)


def chat_ids(tokenizer, context, question):
    messages = [{"role": "user", "content": context + "\n\n" + question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def test_import_restkv_registers_the_task():
    check = "import restkv, transformers.pipelines as p; print(p.PIPELINE_REGISTRY.check_task('" + TASK + "'))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert "RestKVTextGenerationPipeline" in result.stdout, result.stderr
    assert TASK in get_supported_tasks()


def test_the_prompt_is_the_chat_template_split_where_the_context_ends(pipe, tokenizer):
    inputs = pipe.preprocess(CONTEXT, question=QUESTION)
    context_ids, (question_ids,) = inputs["context_ids"][0].tolist(), inputs["question_ids"]
    assert context_ids + question_ids[0].tolist() == chat_ids(tokenizer, CONTEXT, QUESTION)
    start, stop = inputs["context_span"]
    assert stop == len(context_ids)
    assert tokenizer.decode(context_ids[start:stop]) == CONTEXT
    assert tokenizer.decode(context_ids[:start]).endswith("<|im_start|>user\n")  # the template's opening
    assert tokenizer.decode(question_ids[0]).startswith("\n\n" + QUESTION)


def test_answer_prefix_follows_the_generation_prompt_and_a_plain_prompt_is_the_text(pipe, tokenizer):
    prefixed = pipe.preprocess(CONTEXT, question=QUESTION, answer_prefix="The ferry leaves at")
    assert tokenizer.decode(prefixed["question_ids"][0][0]).endswith("<|im_start|>assistant\nThe ferry leaves at")
    plain = pipe.preprocess(CONTEXT, question=QUESTION, chat_template=False)
    ids = torch.cat([plain["context_ids"], plain["question_ids"][0]], dim=-1)[0].tolist()
    assert ids == tokenizer(CONTEXT + "\n\n" + QUESTION)["input_ids"]
    assert plain["context_span"] == (0, plain["context_ids"].shape[1])


def test_kvzip_repeats_the_context_alone(pipe, repeated_pieces):
    span = pipe.preprocess(CONTEXT, question=QUESTION)["context_span"]
    pipe(CONTEXT, question=QUESTION, method="kvzip", compression_ratio=0.5, **GREEDY)
    assert repeated_pieces == [span] and span[0] > 0  # the template's opening is not repeated


def test_questions_share_one_compressed_context_and_each_answer_is_its_own(pipe, prefill_calls):
    options = dict(method="snapkv", max_capacity_prompts=24, window_size=4, **GREEDY)
    alone = [pipe(CONTEXT, question=question, **options) for question in (QUESTION, "Where are tickets sold?")]
    prefill_calls.clear()
    together = pipe(CONTEXT, questions=[QUESTION, "Where are tickets sold?"], **options)
    assert len(prefill_calls) == 1
    assert together == alone and all(set(answer) == {"answer"} for answer in together)


def test_options_as_values_and_given_when_made_compose_the_same_config(tiny, tokenizer, pipe):
    budget = dict(max_capacity_prompts=24, window_size=4)
    flat = pipe(CONTEXT, question=QUESTION, method="snapkv", kernel_size=3, **budget, **GREEDY)
    as_values = pipe(CONTEXT, question=QUESTION, policy=SnapKV(kernel_size=3), **budget, **GREEDY)
    config = restkv.CompressionConfig(method="snapkv", kernel_size=3, **budget)
    assert as_values == flat == pipe(CONTEXT, question=QUESTION, config=config, **GREEDY)
    made_with = pipeline(TASK, model=tiny, tokenizer=tokenizer, method="snapkv", kernel_size=3, **budget)
    assert made_with(CONTEXT, question=QUESTION, **GREEDY) == flat
    # a call's own options replace those the pipeline was made with
    full = made_with(CONTEXT, question=QUESTION, method="fullkv", **GREEDY)
    assert full == pipe(CONTEXT, question=QUESTION, **GREEDY)  # no option: the model as it is, a full cache


@pytest.mark.parametrize("call, error, words", [
    (dict(), PipelineInputError, "give question="),
    (dict(question=QUESTION, questions=[QUESTION]), PipelineInputError, "not both"),
    (dict(questions=[]), PipelineInputError, "questions must be a non-empty list"),
    (dict(questions=[QUESTION, " "]), PipelineInputError, "questions[1]"),
    (dict(question=QUESTION, context="  "), PipelineInputError, "the context is empty"),
    (dict(question=QUESTION, chat_template="yes"), PipelineInputError, "chat_template must be True"),
    (dict(question=QUESTION, compresion_ratio=0.5), ConfigError, "unknown argument 'compresion_ratio'"),
    (dict(question=QUESTION, method="snapkv", compression_ratio=1.5), ConfigError, "--compression_ratio"),
    (dict(question=QUESTION, config=restkv.CompressionConfig(method="fullkv"), window_size=8), ConfigError,
     "give window_size inside it"),
])
def test_bad_input_is_one_line_naming_the_argument_before_the_model_runs(pipe, no_generation, call, error, words):
    context = call.pop("context", CONTEXT)
    with pytest.raises(error) as raised:
        pipe(context, **call)
    assert words in str(raised.value) and "\n" not in str(raised.value)
    assert issubclass(error, ValueError)


def test_a_chat_template_is_refused_on_a_tokenizer_without_one(tiny, tokenizer, no_generation):
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    plain = pipeline(TASK, model=tiny, tokenizer=base)
    with pytest.raises(PipelineInputError, match="chat_template=True, but this tokenizer has no chat template"):
        plain(CONTEXT, question=QUESTION, chat_template=True)
    assert plain.preprocess(CONTEXT, question=QUESTION)["context_span"][0] == 0  # no template: the plain text


@pytest.mark.embedded
def test_fullkv_answers_as_greedy_generate_on_the_chat_prompt(smollm2):
    model, tokenizer = smollm2
    prompt = build_prompts(tokenizer, load_essays(None, 400), [400], [50])[0]
    ids = torch.tensor([chat_ids(tokenizer, prompt.context, prompt.question)])
    generated = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    answer = pipeline(TASK, model=model, tokenizer=tokenizer)(prompt.context, question=prompt.question,
                                                               method="fullkv", max_new_tokens=12, do_sample=False)
    assert answer == {"answer": tokenizer.decode(generated, skip_special_tokens=True).strip()}


@pytest.mark.embedded
def test_kvzip_keeps_the_needle_of_a_1k_token_chat_prompt_at_a_fifth_of_the_context(smollm2):
    model, tokenizer = smollm2
    prompt = build_prompts(tokenizer, load_essays(None, 2000), [1200], [50])[0]
    assert 950 <= len(chat_ids(tokenizer, prompt.context, prompt.question)) <= 1100
    answer = pipeline(TASK, model=model, tokenizer=tokenizer)(prompt.context, question=prompt.question,
                                                               method="kvzip", compression_ratio=0.8,
                                                               max_new_tokens=24, do_sample=False)["answer"]
    assert "eat a sandwich and sit in Dolores Park" in answer, answer


def test_a_delimited_finch_answers_each_question_with_it_as_the_window(pipe, tiny, tokenizer):
    """--finch_delimiter: context, delimiter and question as one prompt through generate (query-aware), the
    answer the one the same prompt gives the model directly."""
    options = dict(method="finch", max_capacity_prompts=48, finch_delimiter=len(tokenizer))
    answers = pipe(CONTEXT, questions=[QUESTION, "Where are tickets sold?"], **options, **GREEDY)
    inputs = pipe.preprocess(CONTEXT, questions=[QUESTION, "Where are tickets sold?"])
    for answer, question_ids in zip(answers, inputs["question_ids"]):
        prompt = torch.cat([inputs["context_ids"], torch.tensor([[len(tokenizer)]]), question_ids], dim=-1)
        with restkv.compression(tiny, **options):
            expected = tiny.generate(prompt, attention_mask=torch.ones_like(prompt), **GREEDY)[0, prompt.shape[-1]:]
            cache = restkv.prefill(tiny, prompt)
        assert answer == {"answer": tokenizer.decode(expected, skip_special_tokens=True).strip()}
        assert cache.get_seq_length() == prompt.shape[-1] - 1
