"""The ``restkv-text-generation`` pipeline task: a context compressed once, then a question (or several) answered.

``import restkv`` registers the task with transformers' pipeline registry::

    from transformers import pipeline
    import restkv

    pipe = pipeline("restkv-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question="Who wrote it?", method="kvzip", compression_ratio=0.9, max_new_tokens=32)
    # {"answer": "..."}
    pipe(context, questions=["Who?", "When?"], method="snapkv", max_capacity_prompts=256)
    # [{"answer": "..."}, {"answer": "..."}]: the context compressed once, each question answered from it

The user turn is ``context + "\\n\\n" + question`` in the tokenizer's chat template with the generation prompt
added (``chat_template=False``, or a tokenizer without a template: that text as it is, for a base model), then
``answer_prefix``. The prompt is split where the context ends: the template's opening and the context are
prefilled and compressed before the question is seen (query-agnostic), and the question, the template's closing
and the answer prefix come after, attending to the compressed cache (``answer_many``). The context's span is set
on the cache, so a reconstruction scorer (``method="kvzip"``) keeps the template's opening and repeats the
context alone (after what ``--reconstruction_prompt`` names, built by ``set_reconstruction_prompt`` and closed
as this prompt is: each call sets it on the model). With ``method="fullkv"`` the answer is ``model.generate``'s
on the whole prompt. A method that finds its window from a question delimiter (``method="finch",
finch_delimiter=ID``) is query-aware by definition: each question is answered by ``model.generate`` on the context,
the delimiter and the question as one prompt, compressed with that question as its window (the context is then
compressed once per question).

Compression options are any of ``CompressionConfig``'s (the flat names, ``config=CompressionConfig(...)``, or
the parts as values: ``policy=SnapKV(kernel_size=7)``); given to a call they replace those given when the
pipeline was made, as ``restkv.compression`` does. (``pipeline(..., config=...)`` is the model's configuration
to transformers, so a whole ``CompressionConfig`` goes to a call; options may also be given flat when the
pipeline is made.) Without any, the model runs as it is configured
(``replace_*``, ``configure``), else with its full cache. Generation options (``max_new_tokens``,
``do_sample``...) go to ``generate``; ``max_new_tokens`` defaults to 50. ``prefill_chunk_size`` is restkv's
(compress the context chunk by chunk), not transformers' option of the same name.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from restkv.config import CompressionConfig, ConfigError, option_names
from restkv.config.parts import PART_ARGUMENTS
from restkv.integrations.transformers.attention import patched_attention_of
from restkv.integrations.transformers.generation import answer_many
from restkv.integrations.transformers.handles import module_config
from restkv.integrations.transformers.patching import compression
from restkv.integrations.transformers.reconstruction_prompt import PLAIN_CLOSING, set_reconstruction_prompt

TASK = "restkv-text-generation"
#: the arguments of a call that shape the prompt
PROMPT_ARGUMENTS = ("question", "questions", "answer_prefix", "chat_template")
#: ``max_new_tokens`` when a call gives no length (``generate``'s own default counts the prompt too)
DEFAULT_NEW_TOKENS = 50
#: what separates the context from the question in the user turn
SEPARATOR = "\n\n"


class PipelineInputError(ValueError):
    """A call of the pipeline cannot run (no question, an empty context, no chat template): the message names the
    argument."""


def compression_arguments() -> set[str]:
    """Every argument that sets the compression: the flat options, ``config=`` and the parts given as values."""
    return {*option_names(), *PART_ARGUMENTS, "switches", "config"}


def generation_arguments() -> set[str]:
    """Every argument that goes to ``generate``: a ``GenerationConfig`` field, a whole one, or a streamer."""
    return {name for name in vars(GenerationConfig()) if not name.startswith("_")} | {"generation_config", "streamer"}


class RestKVTextGenerationPipeline(Pipeline):
    """Answer questions about a context compressed once, before the questions (see the module docstring)."""

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(self, **arguments):
        """Sort a call's arguments into the prompt's, the compression and generation, and the result's shape;
        the compression is composed (and checked) here, before any token is made, and an unknown argument is
        refused by name."""
        compressing, generating = compression_arguments(), generation_arguments()
        unknown = sorted(set(arguments) - compressing - generating - set(PROMPT_ARGUMENTS))
        if unknown:
            raise ConfigError(f"{TASK}: unknown argument {unknown[0]!r}; it takes {', '.join(PROMPT_ARGUMENTS)}, any "
                              "restkv compression option (restkv.describe(method) lists a method's) and generate's "
                              "options")
        preprocess = {name: arguments[name] for name in PROMPT_ARGUMENTS if name in arguments}
        options = {name: value for name, value in arguments.items() if name in compressing}
        forward: dict[str, Any] = {}
        if options:
            forward["config"] = _compression_config(options)
        generate = {name: value for name, value in arguments.items() if name not in compressing and name in generating}
        if generate:
            forward["generate_kwargs"] = generate
        postprocess = {"several": "questions" in arguments} if {"question", "questions"} & set(arguments) else {}
        return preprocess, forward, postprocess

    def preprocess(self, context, question=None, questions=None, answer_prefix="", chat_template=None):
        """The prompt's token ids, split where the context ends: ``context_ids`` ``[1, C]``, one ``[1, Q]`` per
        question, and the context's span in the context ids."""
        asked = _questions(question, questions)
        if not isinstance(context, str) or not context.strip():
            raise PipelineInputError(f"{TASK}: the context is empty; give the text to compress as the first argument")
        if not isinstance(answer_prefix, str):
            raise PipelineInputError(f"{TASK}: answer_prefix must be a string; got {answer_prefix!r}")
        templated = self._uses_template(chat_template)
        prompts = [_render(self.tokenizer, context, asked_question, templated) for asked_question in asked]
        return {**_split(self.tokenizer, prompts, answer_prefix, templated), "templated": templated}

    def _uses_template(self, chat_template) -> bool:
        """Whether prompts go in the tokenizer's chat template: ``chat_template`` if given (True refused without
        one), else whether the tokenizer has one."""
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        if chat_template is None:
            return has_template
        if not isinstance(chat_template, bool):
            raise PipelineInputError(f"{TASK}: chat_template must be True, False or None; got {chat_template!r}")
        if chat_template and not has_template:
            raise PipelineInputError(f"{TASK}: chat_template=True, but this tokenizer has no chat template (a base "
                                     "model?); use chat_template=False to give the text as it is")
        return chat_template

    def _forward(self, inputs, config=None, generate_kwargs=None):
        generate_kwargs = dict(generate_kwargs or {})
        if "max_new_tokens" not in generate_kwargs and "max_length" not in generate_kwargs:
            generate_kwargs["max_new_tokens"] = DEFAULT_NEW_TOKENS
        context = compression(self.model, config) if config is not None else contextlib.nullcontext()
        with context:  # the config is checked against the model first: a refused one changes nothing
            # the repetition a reconstruction scorer reads continues the user turn as this prompt's format closes it
            set_reconstruction_prompt(self.model, self.tokenizer,
                                      closing=None if inputs["templated"] else PLAIN_CLOSING)
            delimiter = _question_delimiter(self.model)
            if delimiter is None:
                answers = answer_many(self.model, inputs["context_ids"], inputs["question_ids"],
                                      context_span=inputs["context_span"], **generate_kwargs)
            else:
                answers = [_answer_delimited(self.model, inputs["context_ids"], delimiter, question, generate_kwargs)
                           for question in inputs["question_ids"]]
        return {"answer_ids": answers}

    def postprocess(self, outputs, several=False):
        """``{"answer": text}``, or a list of them for ``questions=``."""
        answers = [{"answer": self.tokenizer.decode(ids[0], skip_special_tokens=True).strip()}
                   for ids in outputs["answer_ids"]]
        return answers if several else answers[0]


def _compression_config(options: dict[str, Any]) -> CompressionConfig:
    """The config of a call's compression options: ``config=`` alone, or the options composed."""
    if "config" not in options:
        return CompressionConfig.from_options(**options)
    others = sorted(set(options) - {"config"})
    if others:
        raise ConfigError(f"{TASK}: config= is a complete CompressionConfig; give {others[0]} inside it, not beside it")
    return CompressionConfig.from_any(options["config"])


def _question_delimiter(model) -> int | None:
    """The delimiter the model's running config finds its window from (``--finch_delimiter``), or None."""
    attention = patched_attention_of(model.get_decoder())
    config = module_config(attention) if attention is not None else None
    return config.policy.question_delimiter if config is not None else None


def _answer_delimited(model, context_ids: torch.Tensor, delimiter: int, question_ids: torch.Tensor,
                      generate_kwargs: dict) -> torch.Tensor:
    """One question answered query-aware: context, delimiter and question as one prompt, compressed with the
    question as its window."""
    prompt = torch.cat([context_ids, torch.tensor([[delimiter]]), question_ids], dim=-1)
    output = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **generate_kwargs)
    sequences = output.sequences if hasattr(output, "sequences") else output
    return sequences[:, prompt.shape[-1] :]


def _questions(question, questions) -> list[str]:
    """The questions of a call: ``question`` or ``questions``, exactly one of them, none empty."""
    if (question is None) == (questions is None):
        raise PipelineInputError(f"{TASK}: give question='...' or questions=[...] (one of them)" if question is None
                                 else f"{TASK}: give question= or questions=, not both")
    asked = [question] if question is not None else questions
    if isinstance(asked, str) or not isinstance(asked, (list, tuple)) or not asked:
        raise PipelineInputError(f"{TASK}: questions must be a non-empty list of strings; got {questions!r}")
    for index, text in enumerate(asked):
        if not isinstance(text, str) or not text.strip():
            name = "question" if question is not None else f"questions[{index}]"
            raise PipelineInputError(f"{TASK}: {name} must be a question's text; got {text!r}")
    return list(asked)


def _render(tokenizer, context: str, question: str, templated: bool) -> tuple[str, int, int]:
    """The prompt's text for one question, and where the context starts and ends in it."""
    turn = context + SEPARATOR + question
    if not templated:
        return turn, 0, len(context)
    text = tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                         tokenize=False)
    start = text.find(turn)
    if start < 0:
        raise PipelineInputError(f"{TASK}: the tokenizer's chat template changes the user's text, so the context "
                                 "cannot be found in the prompt; use chat_template=False and format it yourself")
    return text, start, start + len(context)


def _split(tokenizer, prompts: list[tuple[str, int, int]], answer_prefix: str, templated: bool) -> dict[str, Any]:
    """Each prompt tokenized whole (so its ids are exactly the whole prompt's), split after the longest run of
    tokens that reads the context's text alone and is the same for every question: the context ids, each
    question's ids, and the context's ``(start, stop)`` among the context ids."""
    def encode(text: str) -> list[int]:  # a rendered template holds its special tokens; a plain text gets them
        return tokenizer(text, add_special_tokens=not templated)["input_ids"]

    whole = [encode(text + answer_prefix) for text, _, _ in prompts]
    text, start, stop = prompts[0]
    opening, through_context = encode(text[:start]), encode(text[:stop])
    length = min(_common(through_context, ids) for ids in whole)
    begin = _common(opening, whole[0])
    if begin >= length:
        raise PipelineInputError(f"{TASK}: the context is empty once tokenized; give the text to compress")
    return {"context_ids": torch.tensor([whole[0][:length]]),
            "question_ids": [torch.tensor([ids[length:]]) for ids in whole], "context_span": (begin, length)}


def _common(first: list[int], second: list[int]) -> int:
    """The length of the common prefix of two id lists."""
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count


def register() -> None:
    """Register ``restkv-text-generation`` with transformers' pipeline registry (what ``import restkv`` does)."""
    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=RestKVTextGenerationPipeline,
                                            pt_model=AutoModelForCausalLM)
