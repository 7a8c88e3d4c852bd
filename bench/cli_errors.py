"""One line and exit status 2 for a bench script's bad input (a TandemError), never a traceback.

Example::

    if __name__ == "__main__":
        run_main(main)
"""
from __future__ import annotations

import sys

from tandem.core.errors import TandemError


def run_main(main) -> None:
    try:
        main()
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
