"""Cold start: the CLI's parser loads no heavy module; the lazy package exports still resolve."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "numpy", "fastapi", "uvicorn", "gguf", "transformers", "online.engine"]


def _loaded_after(code: str) -> dict[str, bool]:
    probe = code + f"\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_parser_with_every_subcommand_imports_no_heavy_module():
    loaded = _loaded_after("from tandem.cli import build_parser\n"
                           "p = build_parser()\n"
                           "assert {'generate', 'serve', 'plan', 'prepare', 'profile', 'train-predictors'} <= "
                           "set(p._subparsers._group_actions[0].choices)")
    assert not any(loaded.values()), f"tandem --help imports {[m for m, v in loaded.items() if v]}"


def test_help_exits_zero_and_lists_commands():
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout and "serve" in out.stdout


def test_lazy_package_exports_resolve_to_the_real_objects():
    import online
    import online.engine
    import online.server
    import predictors
    import predictors.artifact
    from online.server.app import create_app
    assert online.Engine is online.engine.Engine
    assert online.GenerationResult is online.engine.GenerationResult
    assert online.server.create_app is create_app
    assert predictors.load_predictors is predictors.artifact.load_predictors
    try:
        online.NoSuchThing  # noqa: B018
    except AttributeError:
        pass
    else:
        raise AssertionError("unknown attribute did not raise AttributeError")
