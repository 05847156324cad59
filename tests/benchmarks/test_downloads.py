"""``python -m restkv.data NAME``: the layout the runners read, written from stand-ins of the Hub's files (the
tests never reach the network), and the one line with status 2 where the Hub cannot be reached."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from restkv.benchmarks import downloads, infinitebench, longbench
from restkv.benchmarks.downloads import DataUnavailable, fetch
from restkv.benchmarks.sources import INFINITEBENCH, LONGBENCH

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "data" / "fixtures"


def hub_stand_in(files: dict[str, Path]):
    """A ``download`` that serves local files by their path in the repository, and records what it was asked."""
    asked = []

    def download(repo_id: str, filename: str) -> Path:
        asked.append((repo_id, filename))
        if filename not in files:
            raise DataUnavailable(f"cannot get {filename} of {repo_id} from the Hugging Face Hub (stand-in)")
        return files[filename]

    download.asked = asked
    return download


def longbench_archive(tmp_path: Path, names: list[str]) -> Path:
    """A ``data.zip`` laid out as LongBench's, holding the fixture files of ``names``."""
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as bundle:
        for name in names:
            bundle.write(FIXTURES / "LongBench" / f"{name}.jsonl", f"data/{name}.jsonl")
    return archive


def test_longbench_files_come_out_of_the_archive_byte_for_byte_where_the_runner_reads_them(tmp_path):
    download = hub_stand_in({"data.zip": longbench_archive(tmp_path, ["hotpotqa", "qasper_e", "trec"])})
    data_dir = tmp_path / "data" / "LongBench"
    written = fetch(LONGBENCH, ["hotpotqa", "qasper_e"], data_dir, download=download)
    assert download.asked == [("THUDM/LongBench", "data.zip")]
    assert written == [data_dir / "hotpotqa.jsonl", data_dir / "qasper_e.jsonl"]
    for path in written:
        assert path.read_bytes() == (FIXTURES / "LongBench" / path.name).read_bytes()
    assert sorted(path.name for path in data_dir.iterdir()) == ["hotpotqa.jsonl", "qasper_e.jsonl"]  # no leftovers
    samples = longbench.load_samples(argparse.Namespace(data_dir=str(data_dir)), "hotpotqa")
    assert len(samples) == len(longbench.read_records(FIXTURES / "LongBench" / "hotpotqa.jsonl"))


def test_infinitebench_files_are_copied_from_the_repository_root(tmp_path):
    files = {f"{task}.jsonl": FIXTURES / "infinitebench" / f"{task}.jsonl" for task in ("passkey", "code_debug")}
    download = hub_stand_in(files)
    fetch(INFINITEBENCH, ["passkey", "code_debug"], tmp_path / "ib", download=download)
    assert download.asked == [("xinrongzhang2022/InfiniteBench", "passkey.jsonl"),
                              ("xinrongzhang2022/InfiniteBench", "code_debug.jsonl")]
    assert infinitebench.load_task(tmp_path / "ib", "code_debug") == infinitebench.load_task(
        FIXTURES / "infinitebench", "code_debug")


def test_an_unreachable_hub_names_the_files_and_where_they_go_and_writes_nothing(tmp_path):
    data_dir = tmp_path / "LongBench"
    with pytest.raises(DataUnavailable) as error:
        fetch(LONGBENCH, ["hotpotqa", "trec"], data_dir, download=hub_stand_in({}))
    assert str(error.value) == (
        "cannot get data.zip of THUDM/LongBench from the Hugging Face Hub (stand-in); put hotpotqa.jsonl, trec.jsonl "
        "from data/<name>.jsonl of data.zip in the Hugging Face dataset THUDM/LongBench "
        f"(https://huggingface.co/datasets/THUDM/LongBench) into {data_dir}/")
    assert not data_dir.exists()


def test_an_archive_without_a_requested_file_writes_none_of_them(tmp_path):
    download = hub_stand_in({"data.zip": longbench_archive(tmp_path, ["hotpotqa"])})
    with pytest.raises(DataUnavailable, match=r"data.zip of THUDM/LongBench holds no data/trec.jsonl; put hotpotqa"):
        fetch(LONGBENCH, ["hotpotqa", "trec"], tmp_path / "out", download=download)
    assert not (tmp_path / "out").exists()


def test_offline_the_command_says_in_one_line_what_to_put_where_and_exits_2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty cache, no network
    done = subprocess.run([sys.executable, "-m", "restkv.data", "longbench", "--datasets", "hotpotqa", "--data_dir",
                           str(tmp_path / "lb")], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: cannot get data.zip of THUDM/LongBench from the Hugging Face Hub (HF_HUB_OFFLINE is set and the Hub's "
        "cache has no copy); put hotpotqa.jsonl from data/<name>.jsonl of data.zip in the Hugging Face dataset "
        f"THUDM/LongBench (https://huggingface.co/datasets/THUDM/LongBench) into {tmp_path / 'lb'}/"]
    assert not (tmp_path / "lb").exists()


def test_the_command_checks_its_name_and_datasets_before_downloading(capsys, monkeypatch):
    monkeypatch.setattr(downloads, "hub_download", hub_stand_in({}))
    for argv in ([], ["squad"], ["longbench", "--datasets", "hotpotqa", "nosuch"]):
        with pytest.raises(SystemExit) as stop:
            downloads.main(argv)
        assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "unknown NAME 'squad'; NAME is one of longbench, infinitebench, ruler, needle" in err
    assert "--datasets: unknown longbench dataset(s) nosuch" in err


def test_ruler_data_are_generated_by_the_projects_generator(capsys, monkeypatch):
    with pytest.raises(SystemExit) as stop:
        downloads.main(["ruler"])
    assert stop.value.code == 2
    assert "python -m restkv.data ruler --tokenizer MODEL --lengths 4096" in capsys.readouterr().err
    forwarded = []
    monkeypatch.setattr(downloads.ruler_data, "main", forwarded.append)
    downloads.main(["ruler", "--tokenizer", "smollm2-135m", "--lengths", "600"])
    assert forwarded == [["--tokenizer", "smollm2-135m", "--lengths", "600"]]


def test_the_needle_test_downloads_nothing_and_says_which_haystack_it_reads(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    downloads.main(["needle"])
    assert "the haystack is the project's synthetic prose" in capsys.readouterr().out
    (tmp_path / "data" / "PaulGrahamEssays").mkdir(parents=True)
    (tmp_path / "data" / "PaulGrahamEssays" / "a.txt").write_text("An essay. " * 5)
    downloads.main(["needle"])
    assert capsys.readouterr().out.strip() == (
        "needle: the haystack is data/PaulGrahamEssays (found); nothing to download")

