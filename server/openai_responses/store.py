"""Stored Responses: an in-process LRU bounded in bytes, lost on restart.

Each entry keeps the terminal Response object, the canonical input Items of that request, and
the whole Item context a continuation rebuilds (the parent's context, this input, this output),
so deleting or evicting a parent never breaks a stored child.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]
    context: tuple[dict[str, Any], ...]  # Items a previous_response_id child starts from
    preserve_thinking: bool | None  # the resolved value, inherited by children that omit it
    size: int


def entry_size(response: dict[str, Any], input_items: tuple, context: tuple) -> int:
    return sum(len(json.dumps(x, ensure_ascii=False)) for x in (response, list(input_items), list(context)))


class ResponseStore:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def check_fits(self, size: int) -> None:
        if size > self.capacity:
            raise APIError(400, f"the Response ({size} bytes) is larger than the response store "
                           f"({self.capacity} bytes, --response-store-mib); send store: false",
                           "store", "response_store_capacity_exceeded")

    def put(self, response_id: str, response: dict[str, Any], input_items: list[dict[str, Any]],
            context: list[dict[str, Any]], preserve_thinking: bool | None) -> None:
        items, ctx = tuple(input_items), tuple(context)
        size = entry_size(response, items, ctx)
        self.check_fits(size)
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self.used -= old.size
            while self._entries and self.used + size > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self.used -= evicted.size
            self._entries[response_id] = StoredResponse(response, items, ctx, preserve_thinking, size)
            self.used += size

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self.used -= entry.size
            return entry is not None
