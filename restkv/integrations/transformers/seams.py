"""Which attention classes of a transformers model type restkv can serve, judged before anything runs.

restkv runs a model's own attention forward and takes over at two seams: the forward's
``cache.update(key, value, layer_idx)`` and its call of the attention function that
``ALL_ATTENTION_FUNCTIONS.get_interface`` chooses (``restkv.integrations.transformers.attention``). A class is served
when its forward's source shows those seams in the shape restkv reads them:

* it writes a key/value cache through ``cache.update`` (classes that write none, such as vision
  or audio encoders and linear-attention mixers, are not decoder attention and are left alone);
* it calls a registry kernel with the keys ``cache.update`` returned and the ``attention_mask``
  the model built (a mask of its own, such as Doge's learned bias, would be read as none over a
  compressed layer), and the values ``cache.update`` returned, or values derived from them
  (``derives_values``: DiffLlama calls its kernel twice per step, each time with half of the
  heads' values spread over all heads; restkv then checks at the prefill that each call's values
  are the cached ones of some head, and reads them so);
* it has an ``o_proj`` and no attention sinks.

``attention_classes`` finds a model type's decoder attention classes by building its model on
the meta device (no memory, no weights), so a vision tower in the same modeling module is not
judged; ``check_cache_layers`` refuses caches whose attention layers hold more than keys and
values (a convolution state beside them, an indexer's keys), which a compressed layer cannot
replace.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import warnings
from dataclasses import dataclass

import torch

#: cache layer classes whose attention layers restkv replaces, and the layers it leaves alone
#: (linear-attention states of hybrid models, placeholders of attention-free layers)
COMPRESSIBLE_CACHE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")
UNTOUCHED_CACHE_LAYERS = ("LinearAttentionLayer", "DummyLayer")


@dataclass(frozen=True)
class KernelCall:
    """One call of the registry kernel in a forward: the source of its key, value and mask arguments."""

    key: str
    value: str
    mask: str | None


@dataclass(frozen=True)
class ForwardSeams:
    """What an attention forward's source shows of restkv's seams."""

    #: the names ``cache.update`` assigns (keys, values); empty when the forward writes no cache
    updated: tuple[str, ...]
    calls: tuple[KernelCall, ...]
    has_mask_parameter: bool
    has_o_proj: bool
    has_sinks: bool
    #: it hands its keys and values to later layers (KV sharing: Gemma 3n, Gemma 4)
    shares_kv: bool

    @property
    def writes_cache(self) -> bool:
        return bool(self.updated)


def forward_seams(cls: type) -> ForwardSeams:
    """The seams of ``cls.forward``, read from its source (decorators and restkv's wrapper unwrapped)."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
    tree = ast.parse(source)
    kernels: set[str] = set()
    updated: tuple[str, ...] = ()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            called = ast.unparse(node.value.func)
            if called.endswith("get_interface"):
                kernels |= {target.id for target in targets if isinstance(target, ast.Name)}
            elif called.endswith(".update") and "layer_idx" in ast.unparse(node.value):
                for target in targets:
                    if isinstance(target, ast.Tuple):
                        updated = tuple(ast.unparse(element) for element in target.elts)
    calls = tuple(_kernel_call(node) for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in kernels)
    parameters = inspect.signature(inspect.unwrap(cls.forward)).parameters
    return ForwardSeams(updated, calls, "attention_mask" in parameters, "self.o_proj" in source, "s_aux=" in source,
                        "shared_kv" in source or "kv_shared" in source)


def _kernel_call(node: ast.Call) -> KernelCall:
    """The key, value and mask arguments of a kernel call ``f(module, query, key, value, mask, ...)``."""
    given = {keyword.arg: ast.unparse(keyword.value) for keyword in node.keywords if keyword.arg}
    positional = [ast.unparse(arg) for arg in node.args]
    names = ("module", "query", "key", "value", "attention_mask")
    given.update(zip(names, positional))
    return KernelCall(given.get("key", "?"), given.get("value", "?"), given.get("attention_mask"))


def seam_problems(cls: type) -> list[str]:
    """Why restkv cannot serve the decoder attention class ``cls`` (empty: it can)."""
    seams = forward_seams(cls)
    problems = []
    if not seams.calls:
        problems.append("calls an attention function of transformers' registry")
    if not seams.has_o_proj:
        problems.append("has an o_proj output projection")
    if seams.has_sinks:
        problems.append("has no attention sinks (restkv's compressed attention does not read them)")
    if seams.shares_kv:
        problems.append("keeps its keys and values to itself (it shares them with other layers, which would read "
                        "only what a compressed layer holds)")
    keys, values = (seams.updated + ("?", "?"))[:2]
    for call in seams.calls:
        if call.key != keys:
            problems.append(f"hands its kernel the keys and values cache.update returned (it caches {keys}, "
                            f"{values} and hands {call.key}, {call.value})")
        if seams.has_mask_parameter and call.mask != "attention_mask":
            problems.append(f"hands its kernel the attention_mask the model built (it hands {call.mask})")
    return list(dict.fromkeys(problems))


@functools.cache
def derives_values(cls: type) -> bool:
    """Whether ``cls`` hands its kernel values other than those ``cache.update`` returned (DiffLlama's
    per-call halves): restkv then keeps one token set for every head of the layer, stores the cached values
    and reads each call's values from the heads they came from (``restkv.integrations.transformers.attention``)."""
    seams = forward_seams(cls)
    cached = (seams.updated + ("?", "?"))[1]
    return any(call.value != cached for call in seams.calls)


def check_seams(model_type: str, cls: type) -> None:
    """Refuse a decoder attention class restkv cannot serve through transformers' seams, naming the model type."""
    problems = seam_problems(cls)
    if problems:
        raise UnsupportedModel(f"model type {model_type!r} is not supported by restkv: {cls.__name__} needs an "
                               f"attention that {'; '.join(problems)}")


def check_cache_layers(model_type: str, config) -> None:
    """Refuse a model whose cache (``DynamicCache(config=...)``, what ``generate`` builds) holds attention
    layers restkv cannot replace by a compressed one: a layer with a convolution or recurrent state
    beside its keys (Falcon-H1, Zaya) or an indexer's keys (sparse-attention models) would lose them."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config DynamicCache cannot read: the first prefill checks each layer instead
        return
    kinds = {type(layer).__name__ for layer in cache.layers}
    if cache.layers == [] and getattr(cache, "layer_class_to_replicate", None) is not None:
        kinds = {cache.layer_class_to_replicate.__name__}
    odd = sorted(kinds - set(COMPRESSIBLE_CACHE_LAYERS) - set(UNTOUCHED_CACHE_LAYERS))
    if odd:
        raise UnsupportedModel(f"model type {model_type!r} is not supported by restkv: its cache holds "
                               f"{', '.join(odd)} layers (attention keys with another state beside them), which a "
                               "compressed layer cannot replace")


@functools.cache
def attention_classes(model_type: str) -> tuple[tuple[type, ...], tuple[type, ...]]:
    """``(attention classes, decoder classes)`` of a decoder-only model type of transformers' auto mappings:
    the classes of its causal-LM model that write a key/value cache, each checked (``check_seams``), and the
    model classes whose ``layers`` hold them. Raises a one-line ``ValueError`` for a type restkv cannot serve."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in MODEL_MAPPING_NAMES:
        raise UnknownModelType(model_type)
    model_cls = _transformers_class(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    modeling = sys.modules[model_cls.__module__]
    # Every class of the modeling module (a default config may build only some of them: Bamba's has no
    # attention layer), and those the default model is built from (classes imported from another module).
    candidates = {cls for cls in vars(modeling).values() if isinstance(cls, type) and
                  issubclass(cls, torch.nn.Module) and cls.__module__ == modeling.__name__}
    built = _built_on_meta(model_type, model_cls)
    if built is not None:
        candidates |= {type(module) for module in built.modules()}
    attention = tuple(sorted((cls for cls in candidates if cls.__name__.endswith("Attention") and
                              _writes_cache(cls)), key=lambda cls: cls.__name__))
    if not attention:
        raise UnsupportedModel(f"model type {model_type!r} is not supported by restkv: no attention class of it "
                               "writes a key/value cache")
    for cls in attention:
        check_seams(model_type, cls)
    decoders: tuple[type, ...] = ()
    if built is not None:
        check_cache_layers(model_type, built.config)
        # Cross-attention (Mllama's reads the image's keys) is not the decoder's own: left to run natively.
        crossing = {type(module) for module in built.modules()
                    if isinstance(module, attention) and getattr(module, "is_causal", None) is not True}
        attention = tuple(cls for cls in attention if cls not in crossing)
        decoders = tuple(dict.fromkeys(
            type(module) for module in built.modules()
            if isinstance(getattr(module, "layers", None), torch.nn.ModuleList)
            and any(isinstance(inner, attention) for inner in module.layers.modules())))
    return attention, decoders or (_transformers_class(model_type, MODEL_MAPPING_NAMES[model_type]),)


def mapped_model_type(model_type: str | None, model_cls: type) -> str | None:
    """``model_type``, or, when transformers' causal-LM mapping does not list it, the type the mapping gives
    ``model_cls`` (a sub-model's config type: ``mllama_text_model`` is ``MllamaForCausalLM``, type ``mllama``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return model_type
    return next((name for name, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls == model_cls.__name__),
                model_type)


class UnsupportedModel(ValueError):
    """A model restkv cannot serve (its type's attention, its cache, its attention implementation): the
    message names the model type and why. The benchmark commands report it in one line."""


class UnknownModelType(UnsupportedModel):
    """A model type transformers' auto mappings do not list as a decoder-only causal LM."""

    def __init__(self, model_type: str) -> None:
        super().__init__(model_type)
        self.model_type = model_type


def _transformers_class(model_type: str, name: str) -> type:
    """The class transformers' auto mappings name (its modeling module may belong to another type:
    ``internlm3`` is ``LlamaForCausalLM``)."""
    import transformers

    try:
        return getattr(transformers, name)
    except Exception as error:  # a lazy import that needs a package this machine lacks
        raise UnsupportedModel(f"model type {model_type!r} is not supported here: transformers cannot import {name} "
                         f"({type(error).__name__}: {str(error).strip().splitlines()[0][:120]})") from None


def _built_on_meta(model_type: str, model_cls: type):
    """The model built from its default config on the meta device (no memory), or None if that fails."""
    from transformers import AutoConfig

    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            return model_cls(AutoConfig.for_model(model_type))
    except Exception:
        return None


def _writes_cache(cls: type) -> bool:
    try:
        return forward_seams(cls).writes_cache
    except (OSError, TypeError, SyntaxError):  # no source to read: not judged, not patched
        return False
