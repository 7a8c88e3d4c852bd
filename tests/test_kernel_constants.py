"""The C kernels' enum constants (ACT_*, KIND_*) agree with the Python codes the callers pass."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

quantize = importlib.import_module("online.kernels.quantize")  # the package exports a function of that name

NATIVE_DIR = Path(quantize.__file__).parent / "native"
ENUM_RE = re.compile(r"enum\s*\{([^}]*)\}")
ITEM_RE = re.compile(r"^\s*((?:ACT|KIND)_[A-Z0-9_]+)\s*=\s*(\d+)\s*$")


def c_constants() -> dict[str, int]:
    """Every ACT_* / KIND_* enumerator with an explicit value in the native sources."""
    found: dict[str, int] = {}
    for source in sorted(NATIVE_DIR.glob("*.[ch]")):
        for body in ENUM_RE.findall(source.read_text()):
            for item in body.split(","):
                m = ITEM_RE.match(item)
                if m:
                    assert found.setdefault(m[1], int(m[2])) == int(m[2]), f"{m[1]} defined twice with different values"
    return found


def python_constants() -> dict[str, int]:
    codes = {f"ACT_{name.upper()}": value for name, value in quantize.ACT_IDS.items()}
    codes.update({name: getattr(quantize, name) for name in dir(quantize) if name.startswith("KIND_")})
    return codes


def test_c_enums_match_python_codes():
    c, py = c_constants(), python_constants()
    assert {k for k in c if k.startswith("ACT_")} and {k for k in c if k.startswith("KIND_")}  # the parse found both
    assert c == py


def test_enum_parser_sees_a_changed_value():
    body = ENUM_RE.findall("enum { KIND_F32 = 0, KIND_I8 = 7 };")[0]
    values = {m[1]: int(m[2]) for m in map(ITEM_RE.match, body.split(",")) if m}
    assert values == {"KIND_F32": 0, "KIND_I8": 7} and values != {"KIND_F32": 0, "KIND_I8": 1}


def test_the_native_build_key_covers_every_c_source():
    """The compiled library is cached by a hash of SOURCES: a header missing there would let an edit
    run against a stale build."""
    from online.kernels import native
    on_disk = {p.name for p in native.SOURCE_DIR.iterdir() if p.suffix in (".c", ".h")}
    assert on_disk == set(native.SOURCES)
