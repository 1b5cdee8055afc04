"""Faults injected where a real component would raise, for tests of what one failure may end."""
from __future__ import annotations

from ninfer.engine.frontend.qwen_tiktoken import QwenTiktokenTokenizer


class FaultyDecode(QwenTiktokenTokenizer):
    """The Qwen tokenizer, failing to decode any run of ids that holds ``fault_id``: a stand-in
    for a fault in one request's output handling (a tokenizer or stop-string bug)."""

    def __init__(self, inner: QwenTiktokenTokenizer, fault_id: int) -> None:
        super().__init__(inner._qwen)
        self.fault_id = fault_id

    def decode(self, ids):
        if self.fault_id in ids:
            raise KeyError(f"cannot decode {self.fault_id}")
        return super().decode(ids)
