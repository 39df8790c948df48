"""Every script under ``scripts/`` starts: ``--help`` runs its imports and argument parser and exits 0
(a script whose imports broke in a refactor is caught here, not by its first user)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_script_imports_and_parses_its_arguments(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_.value.code in (0, None), capsys.readouterr()
    assert "usage" in capsys.readouterr().out.lower()
