"""A checkpoint's ``tokenizer.json`` through the HF ``tokenizers`` library."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import tokenizers
from tokenizers import decoders

from .tokenizer import Tokenizer


class HFTokenizer(Tokenizer):
    """Wraps a ``tokenizers.Tokenizer``; never adds BOS/EOS, keeps special tokens on decode."""

    def __init__(
        self, backend: tokenizers.Tokenizer, bos_token: str | None = None, eos_token: str | None = None
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_dir(cls, path: str | Path) -> "HFTokenizer":
        """Read ``tokenizer.json``, with BOS/EOS strings from ``tokenizer_config.json`` if present."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(file))
        config = _read_json(path / "tokenizer_config.json")
        return cls(backend, _token_content(config.get("bos_token")), _token_content(config.get("eos_token")))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def control_strings(self) -> list[str]:
        return [t.content for t in self.backend.get_added_tokens_decoder().values() if t.content]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise KeyError(f"no token with id {token_id}")
        if isinstance(self.backend.decoder, decoders.ByteLevel) and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.decode([token_id]).encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: bytes that are printable
    Latin-1 stand for themselves, the others for code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_UNICODE_TO_BYTE = _byte_level_alphabet()


def chat_template_from_dir(path: str | Path) -> str | None:
    """The checkpoint's chat template: ``chat_template.jinja``, else ``tokenizer_config.json``."""
    path = Path(path)
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = _read_json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    data = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` -> ``"<s>"``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
