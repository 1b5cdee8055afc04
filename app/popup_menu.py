"""A popup menu at the pointer, for tray backends without menus (pystray's plain X backend).

Reads the menu (``menu.Entry.to_json`` list) on stdin, prints the chosen entry's path
("6/2": seventh entry, its third child) on stdout, prints nothing when dismissed. It runs in its
own process so that Tk never shares a thread with the tray's event loop.
"""
from __future__ import annotations

import json
import sys


def build(tk, parent, entries: list[dict], choose, path: tuple[int, ...] = ()):
    menu = tk.Menu(parent, tearoff=0)
    for i, e in enumerate(entries):
        here = (*path, i)
        state = "normal" if e["enabled"] else "disabled"
        if e["label"] == "-":
            menu.add_separator()
        elif e["children"]:
            menu.add_cascade(label=e["label"], menu=build(tk, menu, e["children"], choose, here), state=state)
        elif e["checked"] is not None:
            var = tk.BooleanVar(master=parent, value=bool(e["checked"]))
            menu._vars = getattr(menu, "_vars", []) + [var]  # keep the variables alive
            kind = menu.add_radiobutton if e["radio"] else menu.add_checkbutton
            options = {"value": True} if e["radio"] else {"onvalue": True}
            kind(label=e["label"], variable=var, command=lambda h=here: choose(h), state=state, **options)
        else:
            menu.add_command(label=e["label"], command=lambda h=here: choose(h), state=state)
    return menu


def main() -> int:
    import tkinter as tk

    entries = json.load(sys.stdin)
    root = tk.Tk()
    root.withdraw()
    root.title("NInfer menu")
    chosen: list[str] = []

    def choose(path: tuple[int, ...]) -> None:
        chosen.append("/".join(map(str, path)))
        root.after(10, root.destroy)

    menu = build(tk, root, entries, choose)
    x, y = root.winfo_pointerxy()
    root.after(50, lambda: menu.tk_popup(x, y))
    # dismissed without a choice: the menu unmaps and releases its grab
    menu.bind("<Unmap>", lambda _e: root.after(200, lambda: chosen or root.destroy()))
    menu.bind("<Escape>", lambda _e: root.destroy())
    root.mainloop()
    if chosen:
        print(chosen[0], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
