"""The C step's enums (decode.c, rows.h) carry the same numbers as the Python side that fills its structs."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

from online.kernels.cpu_numba import ACT_IDS

quantize = importlib.import_module("online.kernels.quantize")  # the package exports a function of that name

NATIVE = Path(quantize.__file__).parent / "native"


def _c_enum(prefix: str) -> dict[str, int]:
    """Every ``enum { PREFIX_X = n, ... }`` member in the C sources, by name."""
    found: dict[str, int] = {}
    for path in sorted(NATIVE.glob("*.[ch]")):
        for body in re.findall(r"enum\s*\{([^}]*)\}", path.read_text()):
            for name, value in re.findall(rf"\b({prefix}_\w+)\s*=\s*(\d+)", body):
                assert found.setdefault(name, int(value)) == int(value), f"{name} defined twice with different values"
    return found


def test_activation_ids_agree():
    c = _c_enum("ACT")
    assert c, "no ACT_ enum found in the C sources"
    assert c == {f"ACT_{name.upper()}": value for name, value in ACT_IDS.items()}


def test_weight_kind_ids_agree():
    c = _c_enum("KIND")
    python = {name: getattr(quantize, name) for name in dir(quantize) if name.startswith("KIND_")}
    assert c and c == python
