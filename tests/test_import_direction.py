"""Imports run one way: entry points -> online -> placement -> predictors -> offline / synth -> tandem.core.

Every import of every module is read with ``ast`` (imports inside functions included), so a lazy import cannot
hide a back arrow. Entry points (the CLIs and ``tandem.pipeline``) stand on top and may import any floor.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tandem", "online", "offline", "predictors", "placement", "synth")
TOP = 5
# The command-line layer: argument parsing and pipeline driving, the top floor whatever folder holds it.
ENTRY_POINTS = {"tandem", "tandem.cli", "tandem.pipeline", "offline.cli", "predictors.cli", "placement.cli",
                "synth.cli", "online.prepare_cli"}
FLOORS = {"tandem.core": 0, "offline": 1, "synth": 1, "predictors": 2, "placement": 3, "online": 4}


def floor(module: str) -> tuple[int, str]:
    """(floor number, the floor's package) of one of our modules."""
    if module in ENTRY_POINTS:
        return TOP, module
    for package, number in FLOORS.items():
        if module == package or module.startswith(package + "."):
            return number, package
    return TOP, module  # tandem.* outside core: entry points


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import of ours in ``source``, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names if f"{target}.{a.name}" in known]
    return [(line, t) for line, t in out if t.split(".")[0] in PACKAGES]


def back_arrows(modules: dict[str, Path]) -> list[str]:
    known, found = set(modules), []
    for module, path in sorted(modules.items()):
        here, here_package = floor(module)
        for line, target in imports_of(module, path.read_text(), path.name == "__init__.py", known):
            there, there_package = floor(target)
            if here == TOP or there_package == here_package or there < here:
                continue
            found.append(f"{path.relative_to(ROOT)}:{line}: {module} (floor {here}) -> {target} (floor {there})")
    return found


def test_no_import_runs_back_up():
    arrows = back_arrows(our_modules())
    assert not arrows, "imports that run back up:\n" + "\n".join(arrows)


def test_the_walk_sees_lazy_relative_and_from_imports(tmp_path):
    """The checker itself: a back arrow hidden in a function, a relative import and a peer import are named."""
    src = ("def f():\n    from online.engine import Engine\n"
           "from . import collect\nfrom ..synth import build\n")
    known = {"online.engine", "offline.collect", "synth.build"}
    found = imports_of("offline.profiler", src, False, known)
    assert (2, "online.engine") in found and (3, "offline.collect") in found and (4, "synth.build") in found
    assert floor("online.engine")[0] > floor("offline.profiler")[0] == floor("synth.build")[0]
    assert floor("tandem.core.config")[0] == 0 and floor("tandem.pipeline")[0] == TOP


def test_no_module_is_over_400_lines():
    native = sorted((ROOT / "online" / "kernels" / "native").glob("*.[ch]"))  # the C library too
    assert native, "no C sources found under online/kernels/native"
    long = {str(p.relative_to(ROOT)): n for p in [*our_modules().values(), *native]
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines (split them by purpose): {long}"
