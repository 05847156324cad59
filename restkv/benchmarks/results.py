"""A run's results folder: its name and its prediction files.

**Folder.** ``<save_dir>/<model>/<method>_<budget>[_<variant>...][_agnostic][_<tag>]/``
(``fullkv`` has no budget; the variant parts name what makes the run differ from the plain
method: ``snapkv_128_kivi2_think_chunk512``) holds ``run_meta.json`` and one jsonl per dataset: ``<dataset>.jsonl``, or
``<dataset>.shard-<k>-of-<n>.jsonl`` for shard ``k`` of ``n`` (a dataset name with "/" makes a
subfolder). One line per sample, written (flushed and fsynced) as soon as it is generated.

**Resume.** ``ResultWriter`` cuts off a half-written last line (a killed run), so its sample is
redone, and holds an exclusive lock so that a second process cannot write the same file. A
rerun skips every id already written in any file of the dataset; ``read_predictions`` merges
the files of a dataset back into data-file order.

What a folder's predictions depend on (``run_meta.json``) and the checks that keep one run
per folder: ``restkv.benchmarks.run_folder``.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

from restkv.benchmarks.errors import DataError, RunFolderBusy
from restkv.config import CompressionConfig
from restkv.config.options import registered

# --------------------------------------------------------------------------- folder


def budget_label(config: CompressionConfig) -> str:
    """The budget part of a results folder name ("" for fullkv, which keeps everything)."""
    if not config.policy.evicts:
        return ""
    if config.max_capacity_prompts is not None:
        return str(config.max_capacity_prompts)
    return f"ratio{config.compression_ratio:g}"


def variant_parts(config: CompressionConfig) -> list[str]:
    """What a run does beyond its method and budget, as parts of its folder name (and so of the
    evaluators' table rows): an allocation or a merge, quantisation and its bits, each switch the
    method does not turn on itself, an observation that is not the method's own, chunked prefill,
    a decode budget (``adakv``, ``pivot``, ``kivi2``, ``residual``, ``think``, ``reconstruction``,
    ``chunk512``, ``decode1024``)."""
    policy_cls, run = type(config.policy), config.run
    parts = []
    if run.allocation not in ("uniform", config.policy.own_allocation()):
        parts.append(run.allocation)
    if config.merger is not None:
        parts.append(run.merge)
    if config.quantizer is not None:
        parts.append(f"{run.quant_method}{config.nbits}")
    parts += [part.name for part in config.switches if part.name not in policy_cls.own_switches]
    if run.observation != policy_cls.default_observation:
        parts.append(run.observation)
    if run.prefill_chunk_size is not None:
        parts.append(f"chunk{run.prefill_chunk_size}")
    if run.decode_budget is not None:
        parts.append(f"decode{run.decode_budget}")
    return parts


def named_in_folder(option: str) -> bool:
    """Whether a run's folder name says the value of ``option`` (``variant_parts``), so a variant
    that sets only such options needs no ``--tag`` to keep its folder apart."""
    switches = {cls.name for cls in registered("switch")}
    return option in switches or option in ("allocation", "use_pyramid", "merge", "quant_method", "nbits",
                                             "observation", "prefill_chunk_size", "decode_budget")


def results_dir(save_dir: str | Path, model_path: str, config: CompressionConfig,
                query_agnostic: bool = False, tag: str | None = None) -> Path:
    """``<save_dir>/<model>/<method>_<budget>[_<variant>...][_agnostic][_<tag>]`` (``fullkv`` has
    no budget; the variant parts: ``variant_parts``)."""
    from restkv.integrations.transformers.models import model_label

    name = "_".join(part for part in (config.method, budget_label(config), *variant_parts(config)) if part)
    if query_agnostic:
        name += "_agnostic"
    if tag:
        name += f"_{tag}"
    return Path(save_dir) / model_label(model_path) / name


# --------------------------------------------------------------------------- prediction files

SHARD_INFIX = ".shard-"


def shard_path(folder: Path, dataset: str, shard_id: int, num_shards: int) -> Path:
    if num_shards == 1:
        return folder / f"{dataset}.jsonl"
    return folder / f"{dataset}{SHARD_INFIX}{shard_id}-of-{num_shards}.jsonl"


def prediction_files(folder: Path, dataset: str) -> list[Path]:
    """Every file holding predictions of ``dataset`` in ``folder`` (unsharded and shards)."""
    files = [folder / f"{dataset}.jsonl"] + sorted(folder.glob(f"{dataset}{SHARD_INFIX}*-of-*.jsonl"))
    return [path for path in files if path.is_file()]


def datasets_in(folder: Path, pattern: str = "*.jsonl") -> list[str]:
    """Dataset names that have prediction files in ``folder`` (files matching ``pattern``; a
    name is the file's path below ``folder`` without the shard part and ``.jsonl``)."""
    names = {path.relative_to(folder).as_posix()[: -len(".jsonl")].split(SHARD_INFIX)[0]
             for path in folder.glob(pattern)}
    return sorted(names)


def _split_jsonl(path: Path, data: bytes) -> tuple[list[tuple[int, str]], int, bytes]:
    """Numbered complete lines, the byte length they span, and the bytes after the last newline
    (non-empty only when the last write was cut off)."""
    complete_end = data.rfind(b"\n") + 1
    try:
        lines = data[:complete_end].decode("utf-8").split("\n")[:-1]
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text ({error})") from None
    return list(enumerate(lines, start=1)), complete_end, data[complete_end:]


def _parse_record(path: Path, number: int, line: str, need_id: bool) -> dict:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise DataError(f"{path}:{number}: not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
    if need_id and "id" not in record:
        raise DataError(f"{path}:{number}: missing field 'id'")
    return record


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) of every non-blank line of a benchmark data file.

    The one reader of the adapters' data files, so that a line that is not a JSON object
    raises the same ``DataError`` (file and line) in every benchmark.
    """
    path = Path(path)
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, _parse_record(path, number, line, need_id=False)


def read_prediction_file(path: Path) -> list[dict]:
    """The records of one prediction file.

    A last line without its newline is kept if it parses (a file written by another tool),
    else skipped with a warning (the sample in flight of a killed or running job).
    """
    numbered, _, tail = _split_jsonl(path, path.read_bytes())
    records = [_parse_record(path, number, line, need_id=False) for number, line in numbered if line.strip()]
    if tail.strip():
        try:
            records.append(_parse_record(path, len(numbered) + 1, tail.decode("utf-8"), need_id=False))
        except (DataError, UnicodeDecodeError):
            print(f"warning: {path}:{len(numbered) + 1}: skipped a half-written last line", file=sys.stderr)
    return records


def read_predictions(folder: str | Path, dataset: str) -> list[dict]:
    """The predictions of ``dataset`` merged over its files, in data-file order, one per id.

    Records with an ``index`` are sorted by it, so a sharded run gives the same order (and
    the same floating-point sums) as an unsharded one.
    """
    records, seen = [], set()
    for path in prediction_files(Path(folder), dataset):
        for record in read_prediction_file(path):
            key = record.get("id")
            if key is not None and key in seen:
                continue
            seen.add(key)
            records.append(record)
    if all("index" in record for record in records):
        records.sort(key=lambda record: record["index"])
    return records


class ResultWriter:
    """Append-only jsonl of one dataset and shard, safe against kills and double launches.

    On open, a half-written last line (no newline) is cut off, so its sample is redone; an
    exclusive lock stops a second process from writing the same file. Each ``write`` is
    flushed and fsynced, so a killed run loses at most the sample in flight.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a+b")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise RunFolderBusy(f"{path} is being written by another process (same dataset and shard)") from None
        try:
            self._file.seek(0)
            numbered, complete_end, tail = _split_jsonl(path, self._file.read())
            records = [_parse_record(path, number, line, need_id=True) for number, line in numbered if line.strip()]
        except DataError:
            self._file.close()
            raise
        if tail:
            self._file.truncate(complete_end)
            os.fsync(self._file.fileno())
        self.ids = {record["id"] for record in records}

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one line and make it durable before returning."""
        self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.ids.add(record["id"])

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def holds_predictions(folder: Path) -> bool:
    """Whether any prediction file in ``folder`` (or its dataset subfolders) holds a complete line."""
    return any(read_prediction_file(path) for path in folder.rglob("*.jsonl"))
