"""The examples users read: the notebooks run top to bottom, and the public functions show an example each."""

from pathlib import Path

import pytest

import restkv
import restkv.monkeypatch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def text_of(cell) -> str:
    """What a code cell printed or showed."""
    parts = []
    for output in cell.outputs:
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.mark.embedded
def test_the_quickstart_notebook_runs(tmp_path):
    reason = "the notebook smoke test needs {} (pip install 'restkv[test]')"
    nbformat = pytest.importorskip("nbformat", reason=reason.format("nbformat"))
    nbclient = pytest.importorskip("nbclient", reason=reason.format("nbclient"))
    pytest.importorskip("ipykernel", reason=reason.format("ipykernel"))
    notebook = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [text_of(cell) for cell in notebook.cells if cell.cell_type == "code"]
    assert any("attention layers hold fewer entries than tokens seen" in text for text in outputs)
    assert any("kvzip: The special magic number" in text for text in outputs)
    assert "--method kvzip (KVzip)" in outputs[-1] and "arXiv 2505.23416" in outputs[-1]


@pytest.mark.parametrize("function", [
    restkv.compression, restkv.configure, restkv.prefill, restkv.generate_after_context, restkv.answer_many,
    restkv.describe, restkv.cache_report, restkv.kept_positions, restkv.monkeypatch.replace_llama,
    restkv.monkeypatch.replace_mistral, restkv.monkeypatch.replace_qwen2, restkv.monkeypatch.replace_gemma,
], ids=lambda function: function.__name__)
def test_each_entry_point_shows_an_example(function):
    assert "Example" in function.__doc__ and f"{function.__name__}(" in function.__doc__


def test_one_namespace_holds_the_python_surface():
    names = ["compression", "configure", "prefill", "generate_after_context", "answer_many", "cache_report",
             "kept_positions", "describe", "CompressionConfig", "UncompressedPromptWarning"]
    assert set(names) <= set(restkv.__all__) and all(callable(getattr(restkv, name)) for name in names)
