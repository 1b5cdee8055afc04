"""Reasoning sealed into ``encrypted_content`` and opened again when a client sends it back.

A client that keeps no server state (``store: false``, ``include: ["reasoning.encrypted_content"]``)
carries each reasoning Item's text as an opaque blob: Fernet (AES-CBC + HMAC-SHA256 from
``cryptography``) under a per-install key, so the text is neither readable nor forgeable on the
client's side, and a blob altered or made elsewhere is refused before it could reach a prompt.

The key is a file, ``reasoning.key`` in the user's data directory (platformdirs) unless
``--reasoning-key-file`` names another; it is created on first start with mode 0600 and kept, so
blobs stay valid across restarts. Delete it to invalidate every blob handed out.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from ..errors import invalid

KEY_FILE_NAME = "reasoning.key"


def default_key_path() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("ninfer", appauthor=False)) / KEY_FILE_NAME


def load_or_create_key(path: Path) -> bytes:
    """The Fernet key in ``path``, written there first (mode 0600) when the file does not exist.
    Creation is atomic: a server starting at the same moment reads the same key."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(Fernet.generate_key() + b"\n")
            try:
                os.link(tmp, path)  # fails when another process made the file first
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    key = path.read_bytes().strip()
    try:
        Fernet(key)
    except ValueError:
        raise ValueError(f"{path} is not a reasoning key (32 url-safe base64-encoded bytes); delete it to "
                         "make a new one, or pass --reasoning-key-file") from None
    return key


class ReasoningSeal:
    def __init__(self, key: bytes | None = None) -> None:
        """``key``: a Fernet key; None makes one that lives as long as this object (tests, embedding)."""
        self._fernet = Fernet(key or Fernet.generate_key())

    @classmethod
    def from_file(cls, path: Path | None) -> "ReasoningSeal":
        target = path or default_key_path()
        try:
            return cls(load_or_create_key(target))
        except OSError as exc:
            raise ValueError(f"cannot read or create the reasoning key {target}: {exc.strerror}; pass "
                             "--reasoning-key-file PATH") from None

    def seal(self, text: str) -> str:
        return self._fernet.encrypt(text.encode("utf-8")).decode("ascii")

    def open(self, blob: str, param: str) -> str:
        """The reasoning text sealed in ``blob``; a 400 naming ``param`` when it was not made here."""
        try:
            return self._fernet.decrypt(blob.encode("ascii")).decode("utf-8")
        except (InvalidToken, UnicodeError):
            raise invalid(param, "encrypted_content was not issued by this server (altered, or sealed under "
                          "another key)", "invalid_encrypted_content") from None
