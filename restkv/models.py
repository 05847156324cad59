"""Loading a model and its tokenizer, the embedded ones included (``load_model``, ``load_tokenizer``), and
writing one as a Hugging Face folder: the public path of ``restkv.integrations.transformers.models``.

``python -m restkv.models export smollm2-135m DIR`` writes the embedded model where vLLM (or any tool that reads
Hugging Face folders) loads it.
"""

import argparse
import sys

from restkv.integrations.transformers.models import (DTYPES, ModelPathError, export_model, load_model, load_tokenizer,
                                                     model_label, resolve_model_path)

__all__ = ["DTYPES", "export_model", "load_model", "load_tokenizer", "model_label", "resolve_model_path"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m restkv.models", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a model as a Hugging Face folder (safetensors, config, "
                                 "tokenizer, chat template)")
    export.add_argument("model", help="an embedded model name (smollm2-135m, gemma3-270m) or a local folder")
    export.add_argument("folder", help="where to write it (a new or empty folder)")
    args = parser.parse_args(argv)
    try:
        written = export_model(args.model, args.folder)
    except (FileExistsError, ModelPathError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.model} to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
