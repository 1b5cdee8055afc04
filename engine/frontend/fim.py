"""Fill-in-the-middle prompts (code completion in editors) for tokenizers with FIM tokens.

The repository-level order Qwen2.5-Coder and its successors were trained on, as llama.cpp's
``/infill`` renders it (each extra file's name on the line after its separator):

    <|repo_name|>myproject\\n
    <|file_sep|>{filename}\\n{text}          one per extra chunk
    <|file_sep|>filename\\n
    <|fim_prefix|>{prefix}{prompt}<|fim_suffix|>{suffix}<|fim_middle|>

Without the repository tokens the extra chunks are set apart by a plain-text snippet line. The
extra chunks give way first when the prompt is long (their earliest tokens dropped).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .tokenizer import Tokenizer

# spellings of (prefix, suffix, middle, repository, file separator): Qwen's, StarCoder's
SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"),
)
REQUIRED = 3  # prefix, suffix and middle; the repository tokens are optional
PROJECT = "myproject"  # the repository name, as llama.cpp writes it
CURRENT_FILE = "filename"  # the name of the file being edited, as llama.cpp writes it
SNIPPET = "\n\n--- snippet ---\n\n"  # chunk separator without a file separator token


class MissingFimTokens(ValueError):
    def __init__(self, missing: Sequence[str]) -> None:
        super().__init__(f"the model's tokenizer has no fill-in-the-middle tokens ({', '.join(missing)} are missing)")
        self.missing = list(missing)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None
    file_sep: int | None

    @classmethod
    def of(cls, tok: Tokenizer) -> "FimTokens":
        """The FIM tokens of ``tok`` (the first spelling it has all three required tokens of);
        ``MissingFimTokens`` naming Qwen's spelling's missing tokens when it has none."""
        for spelling in SPELLINGS:
            ids = [tok.token_to_id(s) for s in spelling]
            if all(i is not None for i in ids[:REQUIRED]):
                return cls(*ids)
        raise MissingFimTokens([s for s in SPELLINGS[0][:REQUIRED + 2] if tok.token_to_id(s) is None])


@dataclass
class ExtraChunk:
    text: str
    filename: str = "tmp"  # llama.cpp's name for a chunk that gives none


def render(tok: Tokenizer, fim: FimTokens, prefix: list[int], suffix: list[int], prompt: list[int],
           extra: Sequence[ExtraChunk], limit: int | None = None) -> list[int]:
    """The FIM prompt's ids (``prefix``, ``suffix``, ``prompt`` already ids). ``limit``: the most
    tokens it may have; the extra context's earliest tokens are dropped to stay within it."""
    context: list[int] = []
    if fim.repo is not None:
        context += [fim.repo, *tok.encode(PROJECT + "\n")]
    for chunk in extra:
        if fim.file_sep is not None:
            context += [fim.file_sep, *tok.encode(chunk.filename + "\n")]
        else:
            context += tok.encode(SNIPPET)
        context += tok.encode(chunk.text)
    if fim.file_sep is not None:
        context += [fim.file_sep, *tok.encode(CURRENT_FILE + "\n")]
    core = [fim.prefix, *prefix, *prompt, fim.suffix, *suffix, fim.middle]
    if limit is not None:
        room = max(limit - len(core), 0)
        context = context[len(context) - room:] if room < len(context) else context
    return context + core
