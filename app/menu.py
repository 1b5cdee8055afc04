"""The tray menu as plain data: what each entry says, whether it is checked, what it does.

``tray.py`` turns it into a pystray menu; where the tray backend has no menus (pystray's plain X
backend), ``popup_menu.py`` shows the same entries as a popup. Tests walk it without any display.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator


@dataclass
class Entry:
    label: str
    action: Callable[[], None] | None = None
    checked: bool | None = None  # None: not a check item
    radio: bool = False
    enabled: bool = True
    default: bool = False  # what a left click on the icon does
    children: list["Entry"] = field(default_factory=list)

    @property
    def separator(self) -> bool:
        return self.label == "-"

    def to_json(self) -> dict:
        return {"label": self.label, "checked": self.checked, "radio": self.radio, "enabled": self.enabled,
                "children": [c.to_json() for c in self.children]}


SEPARATOR = Entry("-", enabled=False)


def walk(entries: list[Entry], path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Entry]]:
    for i, e in enumerate(entries):
        yield (*path, i), e
        yield from walk(e.children, (*path, i))


def find(entries: list[Entry], path: tuple[int, ...]) -> Entry:
    entry = entries[path[0]]
    for i in path[1:]:
        entry = entry.children[i]
    return entry


def by_label(entries: list[Entry], *labels: str) -> Entry:
    """``by_label(menu, "Context", "8,192")``: the entry reached by these labels (prefix match)."""
    level = entries
    found: Entry | None = None
    for label in labels:
        found = next((e for e in level if e.label == label), None) or next(
            (e for e in level if e.label.startswith(label)), None)
        if found is None:
            raise KeyError(f"no menu entry {label!r} among {[e.label for e in level]}")
        level = found.children
    assert found is not None
    return found
