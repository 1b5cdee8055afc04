"""``ninfer-app``'s tray: the menu's state and actions (``TrayApp``) and the pystray icon around it.

Every setting the user picks is planned first: one that does not fit is refused with the plan's
message and nothing restarts; one that fits is saved and the server restarts with it.
"""
from __future__ import annotations

import copy
import logging
import subprocess
import sys
import threading
from functools import lru_cache
from typing import Callable

from . import window
from .console import SERVER_PID, addresses
from .launch import LaunchOptions, Resolved, child_env, resolve
from .menu import SEPARATOR, Entry, walk
from .plan import CONTEXT_LADDER, DoesNotFit, Want, make_plan
from .settings import AppSettings, data_dir, log_dir
from .supervisor import State, Status, Supervisor, SupervisorConfig

log = logging.getLogger("ninfer.app")
LANES = (1, 2, 4, 8, 16)
DRAFTS = (1, 2, 3, 4)
COLOURS = {State.READY: (46, 160, 67), State.STARTING: (219, 154, 4), State.BACKOFF: (219, 100, 4),
           State.FAILED: (200, 40, 40), State.STOPPED: (120, 120, 120)}


class Opener:
    """How the tray opens things; the tests record calls instead."""

    def chat(self, url: str) -> None:
        window.open_window(url)

    def url(self, url: str) -> None:
        window.open_browser(url)

    def path(self, path: str) -> None:
        window.open_path(path)

    def choose(self, kind: str) -> str | None:
        return window.choose(kind)

    def notify(self, text: str) -> None:
        log.warning(text)


@lru_cache(maxsize=8)
def _shape(model: str | None):
    from .model_info import load_shape

    return load_shape(model)


class TrayApp:
    def __init__(self, settings: AppSettings, probe_result, opener: Opener | None = None,
                 save: Callable[[AppSettings], None] | None = None, supervisor_options: dict | None = None) -> None:
        from .gpu_probe import plan_device

        self.settings = settings
        self.probe = probe_result
        self.device = plan_device(probe_result)
        self.opener = opener or Opener()
        self._save = save or (lambda s: s.save())
        self.resolved: Resolved | None = None
        self.error = ""
        self.on_change: Callable[[], None] = lambda: None
        self.quit_requested = False
        self.supervisor: Supervisor | None = None
        self._lifecycle = threading.Lock()  # a start and a quit one after the other, never interleaved
        self._sup_options = supervisor_options or {}
        self.command_for: Callable[[Resolved], list[str]] = lambda r: r.command  # tests run a stand-in

    # ------------------------------------------------------------------ server
    def _resolve(self, settings: AppSettings) -> Resolved:
        opts = LaunchOptions(model=settings.model, given={"model"}, serve_args=list(settings.extra_args))
        return resolve(opts, settings, self.probe)

    def start(self) -> None:
        """Plan the settings and start the server under a supervisor (nothing once quit)."""
        with self._lifecycle:
            if self.quit_requested:
                return
            try:
                self.resolved = self._resolve(self.settings)
            except (DoesNotFit, FileNotFoundError, ValueError) as exc:
                self.error = str(exc)
                self.opener.notify(self.error)
                self.on_change()
                return
            self.supervisor = Supervisor(
                SupervisorConfig(command=self.command_for(self.resolved),
                                 health_url=self.resolved.base_url + "/health", log_dir=log_dir(),
                                 pid_file=data_dir() / SERVER_PID, env=child_env(), **self._sup_options),
                on_change=lambda status: self.on_change())
            self.supervisor.start()

    def apply(self, **changes) -> bool:
        """Plan the new settings; restart with them when they fit, keep the old ones when not."""
        new = copy.deepcopy(self.settings)
        for key, value in changes.items():
            if key == "model":
                new.use_model(value)
            else:
                setattr(new, key, value)
        if new.share:
            new.ensure_api_key()
        try:
            resolved = self._resolve(new)
        except (DoesNotFit, FileNotFoundError, ValueError) as exc:
            self.opener.notify(f"Not changed: {exc}")
            return False
        self.settings, self.resolved, self.error = new, resolved, ""
        self._save(new)
        if self.supervisor is None:
            self.start()
        else:
            self.supervisor.restart(self.command_for(resolved), resolved.base_url + "/health")
        self.on_change()
        return True

    @property
    def status(self) -> Status:
        return self.supervisor.status if self.supervisor else Status(State.FAILED if self.error else State.STOPPED)

    def headline(self) -> str:
        if self.error:
            return "Not started: " + self.error.split(". ")[0]
        plan = self.resolved.plan if self.resolved else None
        where = f"{plan.model} on {plan.device.name}" if plan else ""
        return f"Server {self.status.describe()}" + (f" - {where}" if where else "")

    # ------------------------------------------------------------------ actions
    def open_chat(self) -> None:
        if self.resolved:
            self.opener.chat(self.resolved.base_url + "/")

    def open_monitor(self) -> None:
        if self.resolved:
            self.opener.url(self.resolved.base_url + "/monitor/")

    def choose_model(self, kind: str) -> None:
        path = self.opener.choose(kind)
        if path:
            self.apply(model=path)

    def view_logs(self) -> None:
        self.opener.path(str(log_dir() / "server.log"))

    def restart(self) -> None:
        if self.supervisor is None:
            self.start()
        else:
            self.supervisor.restart()

    def quit(self) -> None:
        self.quit_requested = True
        with self._lifecycle:  # a start under way finishes first, then its server is stopped
            if self.supervisor is not None:
                self.supervisor.stop()

    # ------------------------------------------------------------------ the menu
    def _fits(self, **want) -> int | None:
        s = self.settings
        base = dict(lanes=s.concurrency, context=s.context, drafts=s.drafts)
        try:
            return make_plan(_shape(s.model), self.device, Want(**{**base, **want})).settings.context
        except (DoesNotFit, FileNotFoundError, ValueError):
            return None

    def entries(self) -> list[Entry]:
        s = self.settings
        plan = self.resolved.plan.settings if self.resolved else None
        try:
            shape = _shape(s.model)
        except (FileNotFoundError, ValueError):
            shape = None
        max_ctx = shape.max_context if shape else CONTEXT_LADDER[0]
        context = [Entry(f"Auto ({plan.context:,})" if plan and s.context is None else "Auto",
                         lambda: self.apply(context=None), s.context is None, True)]
        for v in sorted(c for c in CONTEXT_LADDER if c <= max_ctx):
            ok = self._fits(context=v) is not None
            context.append(Entry(f"{v:,}" + ("" if ok else " (does not fit)"), lambda v=v: self.apply(context=v),
                                 s.context == v, True, enabled=ok))
        lanes = [Entry(f"Auto ({plan.lanes})" if plan and s.concurrency is None else "Auto",
                       lambda: self.apply(concurrency=None), s.concurrency is None, True)]
        for n in LANES:
            ctx = self._fits(lanes=n, context=s.context)
            label = f"{n} ({ctx:,} tokens each)" if ctx else f"{n} (does not fit)"
            lanes.append(Entry(label, lambda n=n: self.apply(concurrency=n), s.concurrency == n, True,
                               enabled=ctx is not None))
        if shape is not None and shape.mtp_layers == 0:
            drafts = [Entry("This model has no MTP head", enabled=False)]
        else:
            drafts = [Entry(f"Auto ({plan.drafts})" if plan and s.drafts is None else "Auto",
                            lambda: self.apply(drafts=None), s.drafts is None, True),
                      Entry("Off", lambda: self.apply(drafts=0), s.drafts == 0, True)]
            drafts += [Entry(str(n), lambda n=n: self.apply(drafts=n), s.drafts == n, True) for n in DRAFTS]
        from .model_info import embedded_module

        embedded = f"Embedded ({embedded_module().EMBEDDED_MODEL_ID})"
        models = [Entry(embedded, lambda: self.apply(model=None), s.model is None, True)]
        models += [Entry(m, lambda m=m: self.apply(model=m), s.model == m, True) for m in s.recent]
        models += [SEPARATOR, Entry("Choose checkpoint folder...", lambda: self.choose_model("folder")),
                   Entry("Choose GGUF file...", lambda: self.choose_model("gguf"))]
        share = [Entry("Share on local network", lambda: self.apply(share=not s.share), s.share)]
        if s.share and self.resolved:
            share += [Entry(f"  {line}", (lambda u=line.split(": ", 1)[1]: self.opener.url(u)))
                      for line in addresses(self.resolved)[1:] if ": http" in line]
        where = self.probe.summary() if self.probe.cpu_mode else f"GPU: {self.device.name}"
        return [
            Entry(self.headline(), enabled=False), Entry(where, enabled=False), SEPARATOR,
            Entry("Open chat", self.open_chat, default=True, enabled=self.resolved is not None),
            Entry("Open monitor", self.open_monitor, enabled=self.resolved is not None), SEPARATOR,
            Entry("Context", children=context), Entry("Concurrency", children=lanes),
            Entry("Speculative drafts", children=drafts), Entry("Model", children=models), *share, SEPARATOR,
            Entry("View logs", self.view_logs), Entry("Restart server", self.restart), Entry("Quit", self.quit),
        ]


# ---------------------------------------------------------------------------------- the icon
def icon_image(state: State, size: int = 64):
    from PIL import Image, ImageDraw

    img = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    d.rounded_rectangle((2, 2, size - 3, size - 3), radius=size // 5, fill=COLOURS.get(state, (90, 90, 90)))
    w = size // 8
    x0, x1, y0, y1 = size * 0.28, size * 0.72, size * 0.24, size * 0.76
    d.rectangle((x0, y0, x0 + w, y1), fill="white")
    d.rectangle((x1 - w, y0, x1, y1), fill="white")
    d.polygon([(x0, y0), (x0 + w * 1.4, y0), (x1, y1), (x1 - w * 1.4, y1)], fill="white")
    return img


def to_pystray(pystray, entries: list[Entry], run: Callable[[Entry], None]):
    items = []
    for e in entries:
        if e.separator:
            items.append(pystray.Menu.SEPARATOR)
            continue
        sub = to_pystray(pystray, e.children, run) if e.children else None
        action = sub if sub is not None else (lambda icon, item, e=e: run(e))
        items.append(pystray.MenuItem(e.label, action, checked=(lambda item, c=e.checked: c) if e.checked is not None
                                      else None, radio=e.radio, enabled=e.enabled, default=e.default))
    return pystray.Menu(*items)


class _OwnDisplay:
    """One thread's own X connection, closed as the thread ends (its threading.local slot goes)."""

    def __init__(self, name: str) -> None:
        import Xlib.display

        self.display = Xlib.display.Display(name)
        self.thread = threading.get_ident()

    def __del__(self) -> None:
        # on its own thread only: dropped on another (at exit, with its daemon thread frozen mid-call
        # and holding the connection's locks) a round trip would wait forever; the socket goes anyway
        if threading.get_ident() != self.thread:
            return
        try:  # a round trip first: a connection that closes can lose what the server had not read yet
            self.display.sync()
            self.display.close()
        except Exception:  # the server may be gone already
            pass


class LoopOnlyDisplay:
    """Stands in for pystray's X connection (``icon._display``) so that only its event loop uses it.

    pystray's X backend runs ``icon.icon = ...``, ``icon.title = ...``, ``icon.visible = ...`` in its
    loop: from another thread it sends the loop a ClientMessage and flushes, on the loop's connection.
    python-xlib (0.33) does not survive that: a thread that flushes while the loop waits for a reply
    (``get_geometry`` as it redraws) sends the loop's request too, sees the reply arrive and returns
    without waking the loop, which then sleeps forever (a dead icon; Xlib.threaded does not help).
    So the loop's thread gets the real connection and any other thread one of its own, opened when
    it first sends: X window ids are the server's, so the message still reaches the icon's window,
    and the loop answers through pystray's queue as before. The loop's thread is pystray's own
    record of it (``icon._thread``, which ``run`` sets first), the one its dispatcher tests."""

    def __init__(self, icon) -> None:
        self._icon = icon
        self._real = icon._display  # noqa: SLF001
        self._own = threading.local()

    def _display(self):
        loop = getattr(self._icon, "_thread", None)
        if loop is not None and loop.ident == threading.get_ident():
            return self._real
        own = getattr(self._own, "conn", None)
        if own is None:
            own = self._own.conn = _OwnDisplay(self._real.get_display_name())
        return own.display

    def __getattr__(self, name: str):
        return getattr(self._display(), name)


class TrayIcon:
    """The pystray icon: the real menu where the backend has one, a popup menu where it has not."""

    def __init__(self, app: TrayApp) -> None:
        import pystray

        self.pystray = pystray
        self.app = app
        self.icon = pystray.Icon("ninfer", icon_image(app.status.state), "NInfer")
        self.has_menu = self.icon.HAS_MENU
        self.icon.menu = self._menu()
        if not self.has_menu and hasattr(self.icon, "_window"):
            # pystray 0.19's X backend never asks for button presses, so a click would not reach
            # the icon: add ButtonPress to its window's event mask
            import Xlib.X

            self.icon._window.change_attributes(  # noqa: SLF001
                event_mask=Xlib.X.ExposureMask | Xlib.X.StructureNotifyMask | Xlib.X.ButtonPressMask)
            self.icon._display.flush()  # noqa: SLF001
        if not self.has_menu and hasattr(self.icon, "_display"):
            self.icon._display = LoopOnlyDisplay(self.icon)  # noqa: SLF001
        self._stale = threading.Event()
        threading.Thread(target=self._refresh_loop, name="ninfer-tray-refresh", daemon=True).start()
        app.on_change = self.refresh

    def _run(self, entry: Entry) -> None:
        if entry.action is not None and entry.enabled:
            entry.action()
        if self.app.quit_requested:
            self.icon.stop()

    def _menu(self):
        if self.has_menu:
            return self.pystray.Menu(lambda: iter(to_pystray(self.pystray, self.app.entries(), self._run)))
        return self.pystray.Menu(self.pystray.MenuItem("Menu", lambda icon, item: self.popup(), default=True))

    def popup(self) -> None:
        """pystray's X backend has no menus: show ours as a popup in its own process."""
        import json

        log = logging.getLogger("ninfer.app")
        try:  # this runs in pystray's event loop: an exception here would end the loop (a dead icon)
            entries = self.app.entries()
            proc = subprocess.run([sys.executable, "-m", "ninfer.app.popup_menu"], capture_output=True, text=True,
                                  input=json.dumps([e.to_json() for e in entries]), timeout=600)
            if proc.returncode:
                log.error("the tray menu failed (exit %d): %s", proc.returncode, proc.stderr.strip()[-2000:])
                return
            chosen = proc.stdout.strip()
            if chosen:
                path = tuple(int(p) for p in chosen.split("/"))
                entry = dict(walk(entries)).get(path)
                if entry is not None:
                    self._run(entry)
        except Exception:
            log.exception("the tray menu failed")

    def refresh(self) -> None:
        """Have the icon, title and menu follow the app's status. Called from the supervisor's
        thread: pystray's X backend can hold the display while its loop waits for an X event, so
        the update runs on a thread of its own and the supervisor never waits on the display."""
        self._stale.set()

    def _refresh_loop(self) -> None:
        while True:
            self._stale.wait()
            self._stale.clear()
            try:
                self._refresh_now()
            except Exception:  # a broken display must not stop later updates
                logging.getLogger("ninfer.app").exception("tray refresh failed")

    def _refresh_now(self) -> None:
        self.icon.icon = icon_image(self.app.status.state)
        self.icon.title = "NInfer: " + self.app.headline()
        if self.has_menu:
            self.icon.update_menu()

    def run(self) -> None:
        if not self.has_menu and hasattr(self.icon, "_window"):
            # pystray's X backend records its loop's thread only after it has released the setup
            # thread, whose first call (showing the icon) reads it: set it first, as the loop will
            # (LoopOnlyDisplay reads it too: from here on only this thread uses the icon's connection)
            self.icon._thread = threading.current_thread()  # noqa: SLF001
        # the server starts on a thread of its own, not in pystray's set-up after the icon is
        # shown: a desktop slow to dock the icon (or one with no tray at all) never holds it back
        threading.Thread(target=lambda: (self.app.start(), self.refresh()), name="ninfer-tray-start",
                         daemon=True).start()
        self.icon.run(setup=lambda icon: (setattr(icon, "visible", True), self.refresh()))
