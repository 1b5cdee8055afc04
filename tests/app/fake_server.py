"""A stand-in for ninfer-serve in supervisor tests: behaviour picked by flags, varied per start
through a counter file.

    fake_server.py --port N --state DIR [--crash-first K] [--exit-code C] [--exit-after S]
                   [--ignore-term] [--spam N]

Each start increments DIR/starts. The first K starts exit with --exit-code after --exit-after
seconds (0: before ever serving /health); later starts serve /health until stopped.
"""
from __future__ import annotations

import argparse
import http.server
import os
import signal
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--crash-first", type=int, default=0)
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--exit-after", type=float, default=0.0)
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--spam", type=int, default=0)
    args = p.parse_args()
    state = Path(args.state)
    counter = state / "starts"
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    print(f"fake server start {n} pid {os.getpid()}", flush=True)
    for i in range(args.spam):
        print(f"log line {i} " + "x" * 100, flush=True)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
    else:
        signal.signal(signal.SIGTERM, lambda *_: (print("graceful stop", flush=True), os._exit(0)))
    crashing = n <= args.crash_first
    if crashing and args.exit_after == 0:
        print(f"crash before serving, exit {args.exit_code}", flush=True)
        return args.exit_code

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"status":"ok"}')

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", args.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if crashing:
        time.sleep(args.exit_after)
        print(f"engine failure, exit {args.exit_code}", flush=True)
        os._exit(args.exit_code)
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
