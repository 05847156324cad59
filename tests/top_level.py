"""Run the repository's top-level scripts (run_*.py, eval*.py, scripts/*.py, scripts/*/*.sh) and
import visualization/ in tests.

pytest puts ``tests/`` on sys.path, not the repository root where those live.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str) -> ModuleType:
    """``import name`` from the repository root (e.g. ``run_ruler``, ``visualization.figures``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(name)


def dry_run_script(script: str, *args: str, **env: str) -> list[list[str]]:
    """Run ``scripts/<script>`` with PYTHON=echo: the python command lines it would run, split."""
    import os
    import subprocess

    result = subprocess.run(["bash", str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": "echo", **env}, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line.split() for line in result.stdout.splitlines()]


def usage_exit(script: str) -> tuple[int, str]:
    """(exit code, stderr) of ``scripts/<script>`` run without arguments."""
    import subprocess

    result = subprocess.run(["bash", str(ROOT / "scripts" / script)], capture_output=True, text=True, timeout=30)
    return result.returncode, result.stderr


def load_scripts_module(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name`` (the scripts import each other that way:
    ``gpu_bench`` takes ``efficiency``'s functions), so a test patches what the script runs."""
    folder = str(ROOT / "scripts")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def run_main(script: str, *args: str) -> tuple[int | str, str]:
    """(exit code or message, stdout) of ``python <script> args...`` for a top-level ``run_*.py``/
    ``eval*.py``, run in this process (its imports are already loaded, so it starts at once)."""
    import contextlib
    import io
    import runpy

    saved_argv, output = sys.argv, io.StringIO()
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stdout(output):
            runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as stop:
        return stop.code or 0, output.getvalue()
    finally:
        sys.argv = saved_argv
    return 0, output.getvalue()


def script_help(script: str) -> tuple[int | str, str]:
    """(exit code, stdout) of ``python <script> --help``."""
    return run_main(script, "--help")
