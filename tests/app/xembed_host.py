"""A minimal XEMBED system tray for tests under Xvfb: owns ``_NET_SYSTEM_TRAY_S0`` and docks icon
windows into a panel at the top right of the screen, as a desktop's tray area would.

    python xembed_host.py   (DISPLAY set; prints "ready" once it owns the selection)
"""
from __future__ import annotations

import sys

import Xlib.display
import Xlib.protocol.event
import Xlib.X

ICON = 32
REQUEST_DOCK = 0


def main() -> int:
    display = Xlib.display.Display()
    screen = display.screen()
    width = screen.width_in_pixels
    panel = screen.root.create_window(width - 6 * ICON, 0, 6 * ICON, ICON + 8, 0, screen.root_depth,
                                      background_pixel=0x303030, event_mask=Xlib.X.SubstructureNotifyMask)
    panel.set_wm_name("tray")
    panel.map()
    selection = display.intern_atom(f"_NET_SYSTEM_TRAY_S{display.get_default_screen()}")
    opcode = display.intern_atom("_NET_SYSTEM_TRAY_OPCODE")
    panel.set_selection_owner(selection, Xlib.X.CurrentTime)
    manager = display.intern_atom("MANAGER")
    event = Xlib.protocol.event.ClientMessage(window=screen.root, client_type=manager,
                                              data=(32, [Xlib.X.CurrentTime, selection, panel.id, 0, 0]))
    screen.root.send_event(event, event_mask=Xlib.X.StructureNotifyMask)
    display.flush()
    print("ready", flush=True)
    docked: dict[int, int] = {}  # window id -> slot; pystray asks again on every icon update
    while True:
        ev = display.next_event()
        if ev.type == Xlib.X.ClientMessage and ev.client_type == opcode:
            fmt, data = ev.data
            if data[1] == REQUEST_DOCK:
                first = data[2] not in docked
                slot = docked.setdefault(data[2], len(docked))
                icon = display.create_resource_object("window", data[2])
                icon.reparent(panel, 4 + slot * (ICON + 4), 4)
                icon.configure(width=ICON, height=ICON)
                icon.map()
                display.flush()
                if first:  # the icon's centre, in screen coordinates
                    print(f"docked {data[2]} at {width - 6 * ICON + 4 + slot * (ICON + 4) + ICON // 2} "
                          f"{4 + ICON // 2}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
