"""Rebuild a Hugging Face ``tokenizers.Tokenizer`` from the vocabulary stored in GGUF metadata.

Two kinds (``tokenizer.ggml.model``):

* ``gpt2``: byte-level BPE with the file's merges; the split regex comes from
  ``tokenizer.ggml.pre``, as llama.cpp picks it.
* ``llama``: SentencePiece BPE: pieces with scores (merges are recovered from the scores when the
  file has none), ``▁`` for spaces, ``<0xXX>`` byte pieces for anything outside the vocabulary.

Tokens typed CONTROL or UNKNOWN become special added tokens and USER_DEFINED ones plain added
tokens, so ``<|im_start|>`` written in text encodes to its single id.
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from ..config import UnsupportedModelError
from ..frontend.hf_tokenizer import HFTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _REST
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _REST
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen3.5: combining marks join letters
_DIGIT = r"\p{N}"

# tokenizer.ggml.pre -> (split regexes applied in order, ignore_merges), following llama.cpp
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{name: ((_GPT2,), False) for name in ("default", "gpt2", "mpt", "olmo", "jais", "trillion")},
    **{
        name: ((_DIGIT, _GPT2), False)
        for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
    },
    **{name: ((_LLAMA3,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{name: ((_LLAMA3,), False) for name in ("dbrx", "smaug-bpe")},
    **{name: ((_QWEN2,), False) for name in ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez")},
    "qwen35": ((_QWEN35,), False),
}


def build_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """The tokenizer described by the ``tokenizer.ggml.*`` keys of ``meta`` (GGUF metadata)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE)"
        )
    typed = list(zip(tokens, types))
    special = [AddedToken(t, special=True, normalized=False) for t, k in typed if k in (CONTROL, UNKNOWN)]
    backend.add_special_tokens(special)
    backend.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    return HFTokenizer(backend, bos_token=token("bos"), eos_token=token("eos"),
                       adds_bos=meta.get("tokenizer.ggml.add_bos_token") is not False)


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a repeated string keeps its first id
    return vocab


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    regexes, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    if any(len(m) != 2 for m in merges):
        raise ValueError("GGUF tokenizer.ggml.merges has an entry that is not a pair")
    backend = Tokenizer(models.BPE(_vocab(tokens), merges, ignore_merges=ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes[:-1]]
    if regexes[-1] == _GPT2:  # ByteLevel's own regex is GPT-2's
        last = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        last = [
            pre_tokenizers.Split(Regex(regexes[-1]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    steps = splits + last
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def spm_merges(vocab: dict[str, int], scores: list[float], mergeable: set[int]) -> list[tuple[str, str]]:
    """BPE merges implied by SentencePiece scores: every split of a piece into two known pieces,
    best-scoring result first (SentencePiece merges the pair whose result scores highest)."""
    found: list[tuple[float, int, int, str, str]] = []
    for piece, pid in vocab.items():
        if pid not in mergeable:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[pid], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    vocab = _vocab(tokens)
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        mergeable = {i for i, t in enumerate(types) if t in (NORMAL, USER_DEFINED)}
        merges = spm_merges(vocab, scores, mergeable)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else next(
        (t for t, k in zip(tokens, types) if k == UNKNOWN), None
    )
    model = models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend
