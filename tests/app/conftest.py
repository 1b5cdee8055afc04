"""App tests keep settings, logs, pid and lock files in a temporary NINFER_APP_HOME."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def app_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "app-home"
    monkeypatch.setenv("NINFER_APP_HOME", str(home))
    return home


@pytest.fixture
def qwen_08b_dir(tmp_path) -> Path:
    """A checkpoint folder with only the config of Qwen3.5-0.8B (the planner reads nothing else)."""
    import json
    from importlib import resources

    known = json.loads(resources.files("ninfer.app").joinpath("known_models.json").read_text())
    path = tmp_path / "Qwen3.5-0.8B"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(known["Qwen3.5-0.8B"]))
    return path
