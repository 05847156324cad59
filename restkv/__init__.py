"""restkv: KV cache compression for Hugging Face transformers models.

Everything a Python user needs is here::

    import restkv
    from restkv.models import load_model, load_tokenizer
    from transformers import pipeline

    model, tokenizer = load_model("smollm2-135m"), load_tokenizer("smollm2-135m")

    # a context compressed before its question, with the chat template applied for you
    pipe = pipeline("restkv-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question="...", method="kvzip", compression_ratio=0.8, max_new_tokens=32)   # {"answer": ...}

    # any generate() call, compressed inside the block
    with restkv.compression(model, method="snapkv", max_capacity_prompts=256):
        answer = model.generate(input_ids, max_new_tokens=32)
        cache = restkv.prefill(model, input_ids)          # the compressed cache itself
    print(restkv.format_report(restkv.cache_report(cache)))

    restkv.describe("kvzip")          # a method's options, defaults, paper and what it composes with

* ``compression``, ``configure``: a model's compression config (a ``with`` block, or until changed);
  ``restkv.monkeypatch.replace_llama`` & co. patch a whole family, as the original release did.
* ``prefill``, ``generate_after_context``, ``answer_many``: a context compressed before its question(s).
* ``cache_report``, ``format_report``, ``kept_positions``: what a cache holds after compression.
* ``describe``, ``available_methods``, ``CompressionConfig``: what can be run, and one run's settings.
* ``compress_kv``: the compression of one layer's tensors, without a model.

Importing the package imports every folder of parts (``policies``, ``allocations``, ``switches``,
``merges``, ``quantizers``); each part registers itself from its own file, so configs can name
it, and a new part is one new file. It also registers the ``restkv-text-generation`` pipeline task
with transformers. A prompt that fits its budget is kept whole, with an ``UncompressedPromptWarning``
once per budget.
"""

from restkv import allocations, merges, policies, quantizers, switches  # noqa: F401  (their parts register)
from restkv.cache import cache_report, format_report, kept_positions
from restkv.config import CompressionConfig, ConfigError
from restkv.config.describe import describe
from restkv.integrations.transformers import text_pipeline
from restkv.integrations.transformers.generation import answer_many, generate_after_context, prefill
from restkv.integrations.transformers.patching import UncompressedPromptWarning, compression, configure
from restkv.pipeline.compress import CompressedKV, compress_kv
from restkv.policies import available_methods

__version__ = "0.1.0"

text_pipeline.register()

__all__ = ["CompressedKV", "CompressionConfig", "ConfigError", "UncompressedPromptWarning", "answer_many",
           "available_methods", "cache_report", "compress_kv", "compression", "configure", "describe", "format_report",
           "generate_after_context", "kept_positions", "prefill"]
