"""``ninfer-app``: the tray launcher (GPU probe, presets, supervised server)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print(
        "ninfer-app: the tray launcher is coming in a later release.\n"
        "For now start the server with `ninfer-serve` or ./launchers/serve.sh.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
