"""The launcher's stored choices and where it keeps its files (platformdirs: the user's data dir).

``NINFER_APP_HOME`` moves everything (settings, logs, pid and lock files) into one folder; the
tests use it, and so can a portable install.
"""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

RECENT_MAX = 6


def data_dir() -> Path:
    home = os.environ.get("NINFER_APP_HOME")
    if home:
        path = Path(home)
    else:
        from platformdirs import user_data_dir

        path = Path(user_data_dir("ninfer", appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_dir() -> Path:
    path = data_dir() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class AppSettings:
    model: str | None = None  # checkpoint folder or .gguf file; None: the embedded model
    recent: list[str] = field(default_factory=list)
    context: int | None = None  # tokens per request; None: the plan picks
    concurrency: int | None = None  # lanes; None: the plan picks
    drafts: int | None = None  # speculative draft tokens; None: the plan picks, 0: off
    share: bool = False  # bind every interface and require the API key
    api_key: str | None = None
    port: int = 8080
    extra_args: list[str] = field(default_factory=list)  # more ninfer-serve flags

    @classmethod
    def load(cls, path: Path | None = None) -> "AppSettings":
        path = path or data_dir() / "settings.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return cls()
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def save(self, path: Path | None = None) -> None:
        path = path or data_dir() / "settings.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2), encoding="utf-8")
        if self.api_key:
            tmp.chmod(0o600)  # it holds the LAN key
        tmp.replace(path)

    def ensure_api_key(self) -> str:
        if not self.api_key:
            self.api_key = secrets.token_urlsafe(24)
        return self.api_key

    def use_model(self, model: str | None) -> None:
        self.model = model
        if model:
            self.recent = [model] + [m for m in self.recent if m != model]
            del self.recent[RECENT_MAX:]
