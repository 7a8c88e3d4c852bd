"""The ``tandem`` command: one entry point, subcommands registered by each component.

Every user error prints one line (``error: ...``) and exits with code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

# OpenMP worker threads (torch's pool and the C kernels') spin after each parallel region. Spinning forever
# starves the other pool on a busy 2-core machine (7-100x slowdowns measured), sleeping at once
# costs a wake-up per kernel call (decode 40.8 tok/s vs 48-50 spinning, measured on a quiet machine).
# A short spin (~tens of microseconds) covers the gap between consecutive decode kernels and then
# yields. Set before torch and the C kernels load; users' own OMP_WAIT_POLICY / GOMP_SPINCOUNT win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from tandem.core.errors import TandemError


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {self.prog}: {message}\n")
        sys.exit(2)


COMPONENT_PARSERS = [  # (module, function registering its subcommands)
    ("online.cli", "add_parsers"),
    ("offline.cli", "add_parsers"),
    ("predictors.cli", "add_parsers"),
    ("placement.cli", "add_parsers"),
    ("online.prepare_cli", "add_parsers"),
    ("online.server.cli", "add_serve_parser"),
    ("synth.cli", "add_parsers"),
]


def _registrars() -> list[Callable]:
    registrars = []
    for module, function in COMPONENT_PARSERS:
        try:
            mod = __import__(module, fromlist=[function])
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue  # component not present in this build
            raise
        if hasattr(mod, function):
            registrars.append(getattr(mod, function))
    return registrars


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="tandem", description="Heterogeneous CPU-GPU LLM inference engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineArgumentParser)
    for register in _registrars():
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None) or getattr(args, "func", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        code = int(handler(args) or 0)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not in the interpreter's exit
        return code
    except TandemError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except OSError as e:  # the output could not be written (e.g. > /dev/full): one line, not a traceback
        _quiet_stdout()
        where = f": {e.filename}" if e.filename else ""
        sys.stderr.write(f"error: {e.strerror or e}{where}\n")
        return 1


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush cannot fail again at exit."""
    try:
        sys.stdout = open(os.devnull, "w")
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
