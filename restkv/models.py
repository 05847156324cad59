"""Loading a model and its tokenizer, the embedded ones included (``load_model``, ``load_tokenizer``): the
public path of ``restkv.integrations.transformers.models``."""

from restkv.integrations.transformers.models import DTYPES, load_model, load_tokenizer, model_label, resolve_model_path

__all__ = ["DTYPES", "load_model", "load_tokenizer", "model_label", "resolve_model_path"]
