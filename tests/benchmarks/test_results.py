"""Results folders: names, prediction files (writer, reader, shards), resume safety."""

from __future__ import annotations

from pathlib import Path

import pytest
from toy_benchmark import lines_of

from restkv.benchmarks import results
from restkv.benchmarks.errors import DataError
from restkv.benchmarks.results import ResultWriter, read_predictions, results_dir
from restkv.config import CompressionConfig


def test_results_folder_names():
    snap = CompressionConfig(method="snapkv", max_capacity_prompts=128)
    assert results_dir("out", "smollm2-135m", snap) == Path("out/smollm2-135m/snapkv_128")
    agnostic = results_dir("out", "/models/Llama-3.1-8B/", snap, query_agnostic=True, tag="k7")
    assert agnostic == Path("out/Llama-3.1-8B/snapkv_128_agnostic_k7")
    ratio = CompressionConfig(method="snapkv", compression_ratio=0.75)
    assert results_dir("out", "smollm2-135m", ratio).name == "snapkv_ratio0.75"
    assert results_dir("out", "smollm2-135m", CompressionConfig(method="fullkv")).name == "fullkv"


@pytest.mark.parametrize("options, name", [
    (dict(quant_method="kivi", nbits=2), "snapkv_128_kivi2"),
    (dict(think=True), "snapkv_128_think"),
    (dict(method="think"), "think_128"),  # the method's own switch is its name
    (dict(prefill_chunk_size=256), "snapkv_128_chunk256"),
    (dict(observation="reconstruction"), "snapkv_128_reconstruction"),
    (dict(method="kvzip"), "kvzip_128"),  # its own observation and allocation
    (dict(method="kvzip", observation="window"), "kvzip_128_window"),
    (dict(decode_budget=512), "snapkv_128_decode512"),
    (dict(allocation="adakv", residual=True), "snapkv_128_adakv_residual"),
    (dict(merge="pivot"), "snapkv_128_pivot"),
    (dict(method="pyramidkv"), "pyramidkv_128"),
    (dict(observation="window", allocation="uniform"), "snapkv_128"),  # the defaults, named or not
])
def test_results_folder_names_say_what_makes_a_run_differ_from_the_plain_method(options, name):
    """Quantised, ThinK, chunked and reconstruction runs once got the plain method's folder (and
    table row): ``snapkv_128_agnostic_multi`` for all of them."""
    config = CompressionConfig(**{"method": "snapkv", "max_capacity_prompts": 128, **options})
    assert results_dir("out", "smollm2-135m", config, query_agnostic=True, tag="multi").name == f"{name}_agnostic_multi"


def test_writer_redoes_a_half_written_last_line(tmp_path):
    path = tmp_path / "d.jsonl"
    with ResultWriter(path) as writer:
        writer.write({"id": "a", "pred": "x"})
        writer.write({"id": "b", "pred": "é"})
    complete = path.read_bytes()
    path.write_bytes(complete + '{"id": "c", "pred": "é'.encode("utf-8")[:-1])  # cut inside a character
    with ResultWriter(path) as writer:
        assert writer.ids == {"a", "b"}
        assert path.read_bytes() == complete
        writer.write({"id": "c", "pred": "z"})
    assert [record["id"] for record in lines_of(path)] == ["a", "b", "c"]


def test_writer_refuses_a_corrupt_line_and_a_second_writer(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        ResultWriter(path)
    path.write_text('{"id": "a"}\n{"pred": "no id"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"d.jsonl:2: missing field 'id'"):
        ResultWriter(path)
    other = tmp_path / "e.jsonl"
    with ResultWriter(other):
        with pytest.raises(RuntimeError, match="being written by another process"):
            ResultWriter(other)


def test_reading_merges_shards_in_data_order(tmp_path, capsys):
    (tmp_path / "d.shard-1-of-2.jsonl").write_text(
        '{"id": "b", "index": 1, "pred": "B"}\n{"id": "d", "index": 3, "pred": "D"}\n{"id": "x", "ind', encoding="utf-8"
    )
    (tmp_path / "d.shard-0-of-2.jsonl").write_text(
        '{"id": "c", "index": 2, "pred": "C"}\n{"id": "a", "index": 0, "pred": "A"}\n', encoding="utf-8"
    )
    (tmp_path / "d.jsonl").write_text('{"id": "a", "index": 0, "pred": "A"}\n', encoding="utf-8")
    (tmp_path / "dd.jsonl").write_text('{"id": "z", "index": 0, "pred": "Z"}\n', encoding="utf-8")
    assert [r["pred"] for r in read_predictions(tmp_path, "d")] == ["A", "B", "C", "D"]
    assert "skipped a half-written last line" in capsys.readouterr().err
    assert results.datasets_in(tmp_path) == ["d", "dd"]


def test_official_prediction_files_are_read_as_they_are(tmp_path):
    """LongBench's pred.py lines: no id, no index; order and every line kept."""
    (tmp_path / "trec.jsonl").write_text('{"pred": "b"}\n{"pred": "a"}\n{"pred": "a"}', encoding="utf-8")
    assert [r["pred"] for r in read_predictions(tmp_path, "trec")] == ["b", "a", "a"]


def test_read_jsonl_numbers_lines_and_names_bad_ones(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n', encoding="utf-8")
    assert list(results.read_jsonl(path)) == [(1, {"a": 1}), (3, {"a": 2})]
    path.write_text('{"a": 1}\n[1]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"data.jsonl:2: expected a JSON object"):
        list(results.read_jsonl(path))
