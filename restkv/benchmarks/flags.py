"""The command line every runner shares: its flags, their checks, sharding, the prompt limit.

Every compression option is a flag ``--<name>`` (``restkv.config.flags``: help, type and choices
from the declaring part, default None so the part's own default applies); this module is the
only one of the benchmarks that builds configs (``compression_config_from_args``,
``full_cache_config``).

``--help`` lists the common flags and the options of the composition given (``--method``, default
``RunOptions``', and the parts named or its method is defined with: ``restkv.config.flags.scoped_options``);
``--help-all`` every flag; every flag is parsed whatever the help lists. ``--config FILE`` and
``--plugin`` are read first (``restkv.benchmarks.config_file``), so plugins' parts are flags.

``parse_args`` checks every value before anything is loaded, so a typo in a sweep script
stops with the flag's name at once: the compression options (the config's own checks), the
datasets, the shard, the lengths and counts, ``--model_path`` when it can only be a local
folder (``restkv.integrations.transformers.models.check_model_path``), and the benchmark's own flags
(``Benchmark.check_flags``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import typing
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from restkv.benchmarks.benchmark import Benchmark
from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import DataError, FlagError
from restkv.config import CompressionConfig, ConfigError
from restkv.config.flags import HelpScope, add_compression_flags, config_from_flags, scoped_options
from restkv.integrations.transformers.models import ModelPathError, check_model_path

#: Prompt-token limits of the original release (ReST-KV run_*.py), keyed by a substring of the
#: lower-cased model path, plus the embedded models and "llama-3-" (hub names of the 8K Llama 3,
#: which matched no key there). The longest matching key wins (the original took the last match
#: in dict order and crashed on no match).
MODEL_MAX_LEN = {
    "smollm2-135m": 7950,
    "gemma3-270m": 7950,
    "llama2": 3950,
    "llama-2": 3950,
    "llama3": 7950,
    "llama-3-": 7950,
    "llama-3-70": 7950,
    "llama-3.1": 127000,
    "mistral": 31500,
    "qwen2.5": 127000,
    "gemma": 7950,
}

#: Tokens left for the answer when the limit comes from the model's context length.
GENERATION_ROOM = 512

#: The smallest prompt limit: the middle cut keeps ``limit // 2`` tokens at each end.
MIN_MODEL_MAX_LEN = 2

#: ``--attn_implementation`` of every command that loads a model for compression
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")

#: flags a runner parses that ``args.command_flags`` (the flags a results folder's run_meta.json records
#: to re-run it) leaves out: the file and the help they came with, and which process of several wrote
#: the folder (a re-run of the folder's settings covers every shard, skipping what is written)
NOT_RERUN = ("config", "help", "help_all", "num_shards", "shard_id")


class _RaisingParser(argparse.ArgumentParser):
    """Raises ``FlagError`` instead of printing this runner's usage, for callers that build a
    runner's command line themselves and report errors under their own usage (the sweep)."""

    def error(self, message: str) -> typing.NoReturn:
        raise FlagError(message)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends a flag's default when it has one (None means "see the help text"); the epilog's
    example lines are kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (action.default not in (None, argparse.SUPPRESS) and "%(default)" not in help_text
                and not isinstance(action, argparse._StoreTrueAction)):
            help_text += " (default: %(default)s)"
        return help_text


def _str_to_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


#: one ``--<name>`` per compression option of every registered part, and the config of the
#: flags that were given (``restkv.config.flags``: built from the parts' own declarations)
compression_config_from_args = config_from_flags


def full_cache_config() -> CompressionConfig:
    """The config that keeps every token (for a sample too short to compress under a ratio)."""
    return CompressionConfig(method="fullkv")


def build_parser(benchmark: Benchmark, add_flags: Callable[[argparse.ArgumentParser], None] | None = None,
                 parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
                 scope: HelpScope | None = None) -> argparse.ArgumentParser:
    """The common flags of every runner, one flag per compression option, and the benchmark's
    own (``add_flags``). ``scope``: the compression options the help lists
    (``restkv.config.flags.scoped_options``; None: all)."""
    parser = parser_class(description=f"Run {benchmark.name} with a compressed KV cache.",
                          formatter_class=_HelpFormatter, add_help=False, epilog=_epilog(benchmark, scope is None),
                          usage="%(prog)s [-h] [--help-all] [--config FILE] [--plugin PATH_OR_MODULE] "
                                "[--method NAME] [options]")
    parser.add_argument("-h", "--help", action="store_true",
                        help="show the common flags and the options of --method (and of the parts given), and exit")
    parser.add_argument("--help-all", action="store_true", help="show every flag of every method and part, and exit")
    add_config_flags(parser, reruns_folders=True)
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_path", default="smollm2-135m",
        help="an embedded model (smollm2-135m, gemma3-270m), a local folder or a hub id",
    )
    model.add_argument("--attn_implementation", default="sdpa", choices=ATTN_IMPLEMENTATIONS,
                       help="attention kernel")
    model.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"],
                       help="default: bfloat16 on CUDA, float32 on CPU")
    model.add_argument("--device_map", default=None,
                       help="default: 'auto' on CUDA (this process's GPU under torchrun), CPU otherwise")
    model.add_argument("--use_cache", type=_str_to_bool, nargs="?", const=True, default=True,
                       help="accepted for the original release's scripts (--use_cache True); compression needs it")
    model.add_argument("--model_max_len", type=int, default=None,
                       help=f"prompt tokens kept (cut in the middle), >= {MIN_MODEL_MAX_LEN}; default per model, "
                            f"by a name in --model_path: {_model_max_len_words()}; else the model's context length "
                            f"minus {GENERATION_ROOM}")

    data = parser.add_argument_group("data")
    data.add_argument("--data_dir", default=benchmark.default_data_dir, help="folder of the benchmark's jsonl files")
    data.add_argument("--dataset", default=None, help="one dataset (the original release's flag)")
    data.add_argument("--datasets", nargs="+", default=None,
                      help="datasets to run, space- or comma-separated "
                           f"(default: {' '.join(benchmark.default_datasets)})")
    data.add_argument("--num_samples", "--max_num_examples", dest="max_num_examples", metavar="N", type=int,
                      default=None,
                      help="only the first N samples of each dataset (--max_num_examples: the original release's "
                           "name); default: all")
    data.add_argument("--max_new_tokens", type=int, default=None, help="override the benchmark's generation length")

    run = parser.add_argument_group("run")
    run.add_argument("--query_agnostic", action=argparse.BooleanOptionalAction, default=False,
                     help="compress the context alone, then feed the question (off: query-aware)")
    run.add_argument("--save_dir", default=f"results/{benchmark.name}", help="root of the results folders")
    run.add_argument("--tag", default=None, help="suffix of the results folder, for variants of one method and budget")
    run.add_argument("--num_shards", type=int, default=None, help="split every dataset over N processes")
    run.add_argument("--shard_id", type=int, default=None, help="this process's shard, 0..N-1")

    add_compression_flags(parser, scope)
    if add_flags is not None:
        add_flags(parser)
    return parser


def _model_max_len_words() -> str:
    """``MODEL_MAX_LEN`` in words: ``llama2, llama-2: 3950; ...``."""
    by_limit: dict[int, list[str]] = {}
    for key, limit in MODEL_MAX_LEN.items():
        by_limit.setdefault(limit, []).append(key)
    return "; ".join(f"{', '.join(keys)}: {limit}" for limit, keys in sorted(by_limit.items()))


def _epilog(benchmark: Benchmark, every_flag: bool) -> str:
    """A worked example, and how to see other flags."""
    dataset = benchmark.default_datasets[0]
    scope = ("" if every_flag else "Compression options of another method: --method NAME --help; every flag: "
             "--help-all.\n")
    return (f"{scope}example:\n"
            f"  %(prog)s --method snapkv --max_capacity_prompts 128 --datasets {dataset} --num_samples 20\n"
            f"  %(prog)s --config run.yaml --window_size 16   # flags from a file, one overridden\n"
            f"  %(prog)s --config results/{benchmark.name}/smollm2-135m/snapkv_128/run_meta.json   # re-run a "
            "results folder's settings")


def parse_args(benchmark: Benchmark, argv: Sequence[str] | None = None,
               add_flags: Callable[[argparse.ArgumentParser], None] | None = None,
               raising: bool = False) -> argparse.Namespace:
    """Parse and check a runner's command line (``--config`` and ``--plugin`` first:
    ``restkv.benchmarks.config_file``); a bad value prints the runner's usage and the message
    (exit status 2), or with ``raising`` raises ``FlagError``. ``--help`` prints the help scoped
    to the composition given, ``--help-all`` every flag."""
    parser_class = _RaisingParser if raising else argparse.ArgumentParser

    def build(scope: HelpScope | None = None) -> argparse.ArgumentParser:
        return build_parser(benchmark, add_flags, parser_class, scope)

    args, parser = parse_command_line(build, argv, run_meta_of=benchmark.name)
    if args.help or args.help_all:
        try:
            scoped = None if args.help_all else scoped_options(vars(args))
        except ConfigError as error:
            parser.error(str(error))
        parser = build(scoped)
        parser.print_help()
        parser.exit()
    try:
        check_flags(args, benchmark)
    except (ConfigError, DataError, FlagError, ModelPathError) as error:
        parser.error(str(error))
    args.command_flags = {name: value for name, value in vars(args).items() if name not in NOT_RERUN}
    return args


def check_flags(args: argparse.Namespace, benchmark: Benchmark) -> None:
    """Every check that needs no model, data file or results folder."""
    if not args.use_cache:
        raise FlagError("--use_cache False: restkv compresses the KV cache, so runs always use it")
    compression_config_from_args(args)
    selected_datasets(args, benchmark)
    shard_of(args)
    check_model_path(args.model_path)
    check_attn_implementation(args.attn_implementation)
    check_output_path(args.save_dir, "--save_dir", folder=True)
    check_minimums(args, {"model_max_len": MIN_MODEL_MAX_LEN, "max_new_tokens": 1, "max_num_examples": 1},
                   names={"max_num_examples": "--num_samples"})
    if benchmark.check_flags is not None:
        benchmark.check_flags(args)


def check_minimums(args: argparse.Namespace, minimums: Mapping[str, float],
                   names: Mapping[str, str] | None = None) -> None:
    """``FlagError`` for a flag (or an item of a list flag) below its minimum; None is "not given".
    ``names``: the flag a destination is written as, where it is not ``--<dest>``."""
    for dest, minimum in minimums.items():
        value = getattr(args, dest)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and item < minimum:
                raise FlagError(f"{(names or {}).get(dest, f'--{dest}')} must be >= {minimum}; got {item}")


def check_output_path(path: str | os.PathLike, flag: str, folder: bool = False) -> Path:
    """``path`` (a file's, or with ``folder`` a folder's) as a ``Path``, after checking that the command
    can write there when its work is done: not a path of the other kind, in a folder that exists or
    can be made, with write permission. ``FlagError`` naming ``flag`` otherwise. Every command checks
    its output paths with this while its flags are parsed (a path found bad only when the results
    are saved loses the work); nothing is created. The path is the one the command writes, as given
    (no ``~`` expansion: a shell has done it)."""
    target = Path(path)
    wanted, other = ("folder", "file") if folder else ("file", "folder")
    if target.exists():
        if target.is_dir() != folder:
            raise FlagError(f"{flag} {path}: a {other}; give a {wanted} path")
        if not os.access(target, os.W_OK):
            raise FlagError(f"{flag} {path}: no permission to write it")
        return target
    existing = target.absolute().parent
    while not existing.exists():  # the folders that will be made, up to one that exists
        existing = existing.parent
    if not existing.is_dir():
        raise FlagError(f"{flag} {path}: cannot make its folder: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FlagError(f"{flag} {path}: cannot write in {existing} (no permission)")
    return target


def check_attn_implementation(name: str) -> None:
    """``--attn_implementation flash_attention_2`` needs the flash-attn package and a CUDA GPU:
    ``FlagError`` before anything loads where either is missing (transformers' own error came
    after the data were read and the model's files loaded)."""
    if name != "flash_attention_2":
        return
    import torch

    if importlib.util.find_spec("flash_attn") is None:
        raise FlagError(f"--attn_implementation {name} needs flash-attn: pip install 'restkv[flash]'")
    if not torch.cuda.is_available():
        raise FlagError(f"--attn_implementation {name} needs a CUDA GPU; this machine has none: use sdpa")


def selected_datasets(args: argparse.Namespace, benchmark: Benchmark) -> list[str]:
    """``--dataset`` or ``--datasets`` (space- or comma-separated; default: the benchmark's default
    set), checked by name, duplicates dropped."""
    if args.dataset is not None and args.datasets is not None:
        raise DataError("give either --dataset or --datasets, not both")
    chosen = [args.dataset] if args.dataset is not None else list(args.datasets or benchmark.default_datasets)
    # "--datasets a,b c" and "--datasets a b c" name the same datasets.
    chosen = [name for entry in chosen for name in entry.split(",") if name]
    unknown = [name for name in chosen if name not in benchmark.datasets]
    if unknown:
        raise DataError(
            f"unknown {benchmark.name} dataset(s) {', '.join(unknown)}; known: {', '.join(benchmark.datasets)}"
        )
    return list(dict.fromkeys(chosen))


def shard_of(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(shard_id, num_shards) from the flags, else from torchrun's RANK/WORLD_SIZE, else (0, 1)."""
    if args.num_shards is None and args.shard_id is not None:
        raise FlagError("--shard_id needs --num_shards")
    if args.num_shards is not None:
        shard_id = 0 if args.shard_id is None else args.shard_id
        num_shards = args.num_shards
    elif int(environ.get("WORLD_SIZE", "1")) > 1:
        shard_id, num_shards = int(environ.get("RANK", "0")), int(environ["WORLD_SIZE"])
    else:
        return 0, 1
    if num_shards < 1:
        raise FlagError(f"--num_shards must be >= 1; got {num_shards}")
    if not 0 <= shard_id < num_shards:
        raise FlagError(f"--shard_id must lie in 0..{num_shards - 1} (--num_shards {num_shards}); got {shard_id}")
    return shard_id, num_shards


def default_model_max_len(model_path: str, model_config: Any | None = None) -> int:
    """Prompt-token limit: the original release's value for the model family (``MODEL_MAX_LEN``),
    else the model's context length minus ``GENERATION_ROOM``."""
    lowered = model_path.lower()
    matches = [key for key in MODEL_MAX_LEN if key in lowered]
    if matches:
        return MODEL_MAX_LEN[max(matches, key=len)]
    context = getattr(model_config, "max_position_embeddings", None)
    if not context or int(context) - GENERATION_ROOM < MIN_MODEL_MAX_LEN:
        raise FlagError(f"cannot tell a prompt limit for {model_path!r} (context length {context}); "
                        "give --model_max_len")
    return int(context) - GENERATION_ROOM
