"""C kernels built on first use with the system C compiler and loaded through ctypes.

``decode.c`` (with ``rows.h``, ``attention.h``, ``arch.h`` (Qwen3 / Gemma 3 layer pieces), and ``batch.h`` / ``rows_multi.h`` for the multi-token step) holds the whole-model decode step (see online.execution.fused_decode);
``module.h`` / ``fdot.h`` the module path's float-activation kernels (online.kernels.cpu_kernels). It is compiled
for this machine (``-march=native``: AVX2/FMA/F16C where the CPU has them, portable C otherwise; VNNI's int8
dot products and AMX tiles for Q8_0 and Q4 rows where it has those: rows.h, blocks_amx.h)
into a cache folder keyed by the source, the flags, the compiler and the CPU, written atomically,
so every later process only loads it. No compiler, or a failed build, raises ``NativeUnavailable``
with the reason in one line; callers then take the torch path.

Example::

    lib = load_native()            # NativeLibrary(lib=<CDLL>, path=..., has_avx2=True, has_vnni=False, has_amx=False, ...)
    lib.lib.tdm_decode(...)
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tandem.core.errors import TandemError

from .structs import bind_signatures

SOURCE_DIR = Path(__file__).parent
SOURCE = SOURCE_DIR / "decode.c"
SOURCES = ("decode.c", "rows.h", "blocks.h", "attention.h", "dequant.h", "predict.h", "rows_multi.h", "batch.h",
           "arch.h", "moe.h", "kquants.h", "blocks_dot.h", "axpy.h", "module.h", "fdot.h", "ffn.h",
           "batch_ffn.h", "kq_single.h", "blocks_multi.h", "blocks_x8.h", "blocks_x8_i8.h", "act_quant.h", "probe.h",
           "attend_parts.h", "blocks_amx.h", "attention_wide.h",
           "attention_values.h", "units.h")  # everything the build reads (the cache key)
BASE_FLAGS = ("-O3", "-std=gnu11", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
              "-ffp-contract=off")  # a * b + c rounds twice everywhere: no call site differs by inlining
HOST_FLAGS = ("-march=native",)
COMPILE_TIMEOUT_S = 120
# How long an OpenMP thread spins at a barrier before it sleeps (libgomp's GOMP_SPINCOUNT; the user's
# own setting or OMP_WAIT_POLICY wins). The `tandem` CLI sets the same value before torch loads (tandem/cli.py); this
# covers the Python API, whose process never ran the CLI. The step has ~4 barriers a layer; with
# libgomp's default (300k spins) another process holding one of the two cores made each barrier wait
# out a time slice: SmolLM2 decode fell from ~120 to 1-25 tok/s (38-40 with this value, the same
# speed on an idle machine: bench/RESULTS.md, "barrier spin").
BARRIER_SPIN_COUNT = "30000"


class NativeUnavailable(TandemError):
    """The C kernels cannot be built or loaded here (the message says why)."""


@dataclass(frozen=True)
class NativeLibrary:
    lib: ctypes.CDLL
    path: Path
    has_avx2: bool  # the vector kernels (AVX2, FMA, F16C)
    has_vnni: bool = False  # VNNI's vpdpbusd for the int8 block dots
    has_amx: bool = False  # AMX tiles for Q8_0's and Q4's multi-token products (Linux grants them at first use)
    has_wide_attention: bool = False  # attention's kernels on 512-bit vectors (attention_wide.h; the same bits)

    @classmethod
    def opened(cls, lib: ctypes.CDLL, path: Path) -> "NativeLibrary":
        bits = int(lib.tdm_simd_features() if hasattr(lib, "tdm_simd_features") else lib.tdm_has_avx2())
        return cls(lib=lib, path=path, has_avx2=bool(bits & 1), has_vnni=bool(bits & 2), has_amx=bool(bits & 4),
                   has_wide_attention=bool(bits & 8))


def cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem"


def _writable_native_dir() -> Path:
    """cache_dir()/native, or a per-user folder in the temp dir when that cannot be written (only
    if this user owns it: a shared library is loaded from there)."""
    for folder in (cache_dir() / "native", Path(tempfile.gettempdir()) / f"tandem-native-{os.getuid()}"):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(folder, os.W_OK) and folder.stat().st_uid == os.getuid():
                return folder
        except OSError:
            continue
    raise NativeUnavailable(f"no writable folder for the C kernels (tried {cache_dir() / 'native'} and the temp dir)")


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise NativeUnavailable(f"no C compiler found ({cc!r} is not on PATH; set CC or install gcc)")
    return path


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + "|" + flags.strip()


def _build(cc: str, flags: tuple[str, ...], out: Path) -> str | None:
    """Compile decode.c to ``out`` atomically; the compiler's complaint on failure, else None."""
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-I", str(SOURCE_DIR), "-o", tmp, str(SOURCE), "-lm"],
                              capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return lines[0] if lines else f"exit code {proc.returncode}"
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=8)
def _open_library(path: str) -> ctypes.CDLL:
    """dlopen + signatures once per process and library file (content-keyed, never rewritten):
    every packed weight asks for the library on its first product."""
    if "OMP_WAIT_POLICY" not in os.environ:  # read by libgomp when the library loads it (as tandem/cli.py)
        os.environ.setdefault("GOMP_SPINCOUNT", BARRIER_SPIN_COUNT)
    lib = ctypes.CDLL(path)
    bind_signatures(lib)
    return lib


def load_native(extra_flags: tuple[str, ...] = ()) -> NativeLibrary:
    """Build (once per machine, source version and flags) and load the C kernels. ``extra_flags`` go after
    the defaults, e.g. ``("-mno-avx512vnni", "-mno-avxvnni")`` for the build a CPU without VNNI gets."""
    if os.environ.get("TANDEM_NATIVE", "1") == "0":
        raise NativeUnavailable("native kernels disabled by TANDEM_NATIVE=0")
    extra_flags = tuple(extra_flags)
    bad = next((f for f in extra_flags if not isinstance(f, str) or not f.startswith("-") or " " in f), None)
    if bad is not None:
        raise TandemError(f"extra_flags takes compiler options one by one, like '-mno-avxvnni'; got {bad!r}")
    cc = _compiler()
    source = b"\0".join((SOURCE_DIR / name).read_bytes() for name in SOURCES)
    errors = []
    folder = _writable_native_dir()
    for flags in (BASE_FLAGS + HOST_FLAGS + extra_flags, BASE_FLAGS + extra_flags):  # -march=native: not everywhere
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), cc.encode(),
                                         _cpu_signature().encode()])).hexdigest()[:16]
        path = folder / f"tandem_decode-{key}.so"
        if not path.exists():
            error = _build(cc, flags, path)
            if error is not None:
                errors.append(error)
                continue
        try:
            lib = _open_library(str(path))
        except OSError as exc:
            errors.append(str(exc))
            continue
        return NativeLibrary.opened(lib, path)
    raise NativeUnavailable("could not build the C decode kernels: " + "; ".join(errors))
