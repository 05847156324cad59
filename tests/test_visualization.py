"""Figures from result files: what they draw, from tiny synthetic result files (and one real layer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from top_level import load_script

figures = load_script("visualization.figures")
visualize = load_script("visualization.visualize")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 5000


def test_needle_heatmap_from_results_file(tmp_path):
    from restkv.benchmarks import needle

    cells = [{"context_length": n, "depth_percent": d, "response": "", "score": (n / 3000) * (1 - d / 200)}
             for n in (1000, 2000, 3000) for d in (0, 50, 100) if (n, d) != (3000, 100)]
    run = tmp_path / "run"
    run.mkdir()
    needle.write_results(cells, run / "needle_results.json")
    out = visualize.main(["needle", "--results", str(run), "--pretrained_length", "2500"])
    assert out == run / "needle_heatmap.png"
    assert_png(out)
    figure = figures.needle_heatmap(cells, tmp_path / "again.png", title="m")
    axes = figure.axes[0]
    drawn = axes.images[0].get_array()
    assert drawn.shape == (3, 3) and drawn[0, 0] == pytest.approx(1000 / 3000) and np.ma.is_masked(drawn[2, 2])
    assert axes.get_xlabel() == "Token Limit" and axes.get_ylabel() == "Depth Percent"
    assert axes.get_title() == f"m average score={np.mean([c['score'] for c in cells]):.2f}"
    with pytest.raises(ValueError, match="no needle results"):
        figures.needle_heatmap([], tmp_path / "x.png")


def _scored_run(root, name, method, budget, **score_files):
    folder = root / name
    folder.mkdir(parents=True)
    config = {"method": method, "max_capacity_prompts": budget}
    (folder / "run_meta.json").write_text(json.dumps({"settings": {"config": config}}))
    for file_name, content in score_files.items():
        (folder / f"{file_name}.json").write_text(json.dumps(content))
    return folder


def test_budget_curves_from_scored_run_folders(tmp_path):
    _scored_run(tmp_path, "snapkv_128", "snapkv", 128, ruler_scores={"4096": {"vt": 40.0, "cwe": 60.0}},
                metrics={"average": 30.0})
    _scored_run(tmp_path, "snapkv_512", "snapkv", 512, ruler_scores={"4096": {"vt": 80.0}, "8192": {"vt": 60.0}})
    _scored_run(tmp_path, "restkv_128", "restkv", 128, ruler_scores={"4096": {"vt": 70.0}})
    _scored_run(tmp_path, "fullkv", "fullkv", None, ruler_scores={"4096": {"vt": 95.0}})
    _scored_run(tmp_path, "unscored", "snapkv", 64)
    _scored_run(tmp_path, "ratio", "snapkv", None, ruler_scores={"4096": {"vt": 10.0}})
    rows = figures.read_run_scores(tmp_path)
    by_run = {(r["benchmark"], r["method"], r["budget"]): r["score"] for r in rows}
    assert by_run == {("LongBench", "snapkv", 128): 30.0, ("RULER", "snapkv", 128): 50.0,
                      ("RULER", "snapkv", 512): 70.0, ("RULER", "restkv", 128): 70.0, ("RULER", "fullkv", None): 95.0}
    out = visualize.main(["budget", "--results_root", str(tmp_path)])
    assert_png(out)
    figure = figures.budget_curves(rows, tmp_path / "curves.png")
    ruler_axes = figure.axes[1]
    assert ruler_axes.get_title() == "RULER"
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ruler_axes.get_lines()}
    assert lines["snapkv"] == ([128, 512], [50.0, 70.0]) and lines["restkv"] == ([128], [70.0])
    assert lines["fullkv"][1] == [95.0, 95.0]  # the full-cache reference line


def test_budget_curves_keep_variants_of_a_method_apart(tmp_path):
    """Runs of one method with other switches or modes (their folders say so) were averaged into
    one line under the method's name."""
    _scored_run(tmp_path, "snapkv_128", "snapkv", 128, ruler_scores={"4096": {"vt": 40.0}})
    _scored_run(tmp_path, "snapkv_128_residual_agnostic", "snapkv", 128, ruler_scores={"4096": {"vt": 80.0}})
    _scored_run(tmp_path, "snapkv_256_residual_agnostic", "snapkv", 256, ruler_scores={"4096": {"vt": 90.0}})
    rows = figures.read_run_scores(tmp_path)
    assert {(r["method"], r["budget"]): r["score"] for r in rows} == {
        ("snapkv", 128): 40.0, ("snapkv_residual_agnostic", 128): 80.0, ("snapkv_residual_agnostic", 256): 90.0}
    with pytest.raises(ValueError, match="no scores"):
        figures.budget_curves([], tmp_path / "none.png")


def test_budget_curves_give_every_method_its_own_marker(tmp_path):
    """Methods with equal scores at equal budgets drew the same dot on top of one another."""
    rows = [{"benchmark": "RULER", "method": method, "budget": 128, "score": 50.0} for method in ("a", "b", "c")]
    lines = figures.budget_curves(rows, tmp_path / "curves.png").axes[0].get_lines()
    assert len({line.get_marker() for line in lines}) == 3


def test_the_results_table_figure_is_redrawn_from_its_json(tmp_path):
    from restkv.benchmarks import tables

    rows = [{"benchmark": "ruler", "setting": setting, "method": method, "compression_ratio": 0.9, "kv_kept": 0.1,
             "task": tables.AVERAGE, "score": 50.0, "n": 4, "stderr": 10.0}
            for setting in (tables.QUERY_AWARE, tables.QUERY_AGNOSTIC) for method in ("snapkv", "kvzip")]
    _, json_path, _ = tables.write_table(rows, tmp_path / "sweep_table")
    out = visualize.main(["table", "--table", str(json_path)])
    assert out == tmp_path / "sweep_table.png"
    assert_png(out)
    with pytest.raises(SystemExit, match="--table .*nosuch.json: no such file"):
        visualize.main(["table", "--table", str(tmp_path / "nosuch.json")])


def test_efficiency_plot_from_rows_file(tmp_path):
    rows = [
        {"method": method, "prompt_tokens": n, "budget": 128, "prefill_s": n / 1000 * factor,
         "decode_s_per_token": 0.01 * factor, "cache_bytes": (n if method == "fullkv" else 128) * 1024}
        for method, factor in (("fullkv", 1.0), ("snapkv", 1.1)) for n in (2048, 1024) for _ in range(2)
    ]
    path = tmp_path / "efficiency.json"
    path.write_text(json.dumps(rows))
    out = visualize.main(["efficiency", "--results", str(path)])
    assert out == tmp_path / "efficiency.png"
    assert_png(out)
    figure = figures.efficiency_plot(rows, tmp_path / "e.png")
    prefill, decode, memory = figure.axes[:3]
    def line_of(axes, label):
        return {line.get_label(): line for line in axes.get_lines()}[label]

    snap = line_of(prefill, "snapkv")
    assert list(snap.get_xdata()) == [1024, 2048]
    assert list(snap.get_ydata()) == pytest.approx([1.1 * 1.024, 1.1 * 2.048])
    assert list(line_of(decode, "fullkv").get_ydata()) == pytest.approx([10.0, 10.0])  # ms per token
    assert list(line_of(memory, "fullkv").get_ydata()) == pytest.approx([1.0, 2.0])  # MiB
    # Several budgets of one method: one line each.
    more = rows + [dict(rows[4], budget=256)]
    labels = {line.get_label() for line in figures.efficiency_plot(more, tmp_path / "f.png").axes[0].get_lines()}
    assert labels == {"fullkv", "snapkv (128)", "snapkv (256)"}


@pytest.mark.embedded
def test_attention_maps_of_a_real_layer(smollm2, tmp_path):
    from restkv import CompressionConfig

    attention_maps = load_script("visualization.attention_maps")
    model, tokenizer = smollm2
    ids = tokenizer("The grass is green. " * 30 + "The magic number is 6433012. " + "The sky is blue. " * 20,
                    return_tensors="pt").input_ids
    config = CompressionConfig.from_options(method="snapkv", max_capacity_prompts=48)
    maps = attention_maps.layer_attention(model, ids, layer_idx=10, head=4, config=config, last_queries=40)
    length = ids.shape[1]
    assert maps.before.shape == maps.after.shape == (40, length) and maps.first_query == length - 40
    assert np.allclose(maps.before.sum(-1), 1, atol=1e-4) and np.allclose(maps.after.sum(-1), 1, atol=1e-4)
    assert len(maps.kept) == 48 and all(0 <= k < length for k in maps.kept)
    evicted = np.setdiff1d(np.arange(length), maps.kept)
    assert np.all(maps.after[:, evicted] == 0)
    assert set(range(length - 32, length)) <= set(maps.kept)  # the observation window is always kept
    # The causal map: query i never attends to a later key.
    assert maps.before[0, maps.first_query + 1:].sum() == 0
    out = tmp_path / "attention.png"
    figures.attention_maps(maps.before, maps.after, maps.kept, out, marks={"needle": 150}, first_query=maps.first_query)
    assert_png(out)
    with pytest.raises(ValueError, match="query heads 0..8"):
        attention_maps.layer_attention(model, ids, 10, 9, config)
    with pytest.raises(ValueError, match="attention layers 0..29"):
        attention_maps.layer_attention(model, ids, 30, 0, config)
