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
        self, backend: tokenizers.Tokenizer, bos_token: str | None = None, eos_token: str | None = None,
        adds_bos: bool = True,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.adds_bos = adds_bos
        self._max_token_bytes = max_token_bytes(json.loads(backend.to_str()))  # once, not on a request

    @classmethod
    def from_dir(cls, path: str | Path) -> "HFTokenizer":
        """Read ``tokenizer.json``, with BOS/EOS strings from ``tokenizer_config.json`` if present."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(file))
        config = _read_json(path / "tokenizer_config.json")
        return cls(backend, _token_content(config.get("bos_token")), _token_content(config.get("eos_token")),
                   adds_bos=config.get("add_bos_token") is not False)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it throughout), so the event
        # loop and the engine thread run beside a long prompt's tokenization
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_alone(self, text: str) -> list[int]:
        # the tokenizer.json's post-processor adds them (a GGUF-built backend has none)
        return self.backend.encode_batch([text], add_special_tokens=True)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def control_strings(self) -> list[str]:
        return [t.content for t in self.backend.get_added_tokens_decoder().values() if t.content]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def max_token_bytes(self) -> int | None:
        return self._max_token_bytes

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


# Pipeline parts that keep every byte of their input, or add to it: after them each input byte is
# still in exactly one token. A normalizer that may shrink text (NFC, lowercase, a general Replace)
# or a pre-tokenizer that drops some (whitespace splitters, ``Removed`` splits) leaves no bound.
_KEEPING = {"Prepend", "ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTING = {"Split", "Punctuation"}  # keeping unless their behavior is Removed


def _keeps_text(part: dict[str, Any] | None) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in part.get("normalizers") or part.get("pretokenizers") or [])
    if kind == "Replace":  # a fixed string for one no shorter
        pattern = part.get("pattern") or {}
        return "String" in pattern and len(part.get("content", "").encode()) >= len(pattern["String"].encode())
    return kind in _KEEPING or (kind in _SPLITTING and part.get("behavior") != "Removed")


def _byte_level(part: dict[str, Any] | None) -> bool:
    if part is None:
        return False
    return part.get("type") == "ByteLevel" or any(_byte_level(p) for p in part.get("pretokenizers") or [])


def max_token_bytes(config: dict[str, Any]) -> int | None:
    """The most input bytes one token can hold, from a ``tokenizer.json`` (``Tokenizer.to_str()``):
    the longest vocabulary piece (in bytes; a byte-level piece has one character per byte) or
    added token; None unless the pipeline keeps every byte (``_keeps_text``) and the model is BPE
    without fused unknowns (a fused ``unk`` stands for any run of text)."""
    model = config.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")):
        return None
    if not (_keeps_text(config.get("normalizer")) and _keeps_text(config.get("pre_tokenizer"))):
        return None
    added = config.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):  # they take in the whitespace around them
        return None
    size = len if _byte_level(config.get("pre_tokenizer")) else (lambda piece: len(piece.encode()))
    longest = max((size(piece) for piece in model.get("vocab") or {}), default=0)
    longest = max([longest, *(len(t["content"].encode()) for t in added)])
    if model.get("unk_token") is not None:
        longest = max(longest, 4)  # an unknown character: one token for up to 4 bytes
    return longest or None


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
