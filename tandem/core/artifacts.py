"""Typed, versioned artifacts: ``NAME.safetensors`` (tensors) + ``NAME.json`` (metadata).

Every artifact directory is written atomically: files go to a temporary sibling directory that
is renamed into place only when complete, so an interrupted run leaves no half artifact. The metadata
carries ``content_sha256``, a checksum over itself (canonical JSON) and the tensor file: an edited or
damaged artifact is refused when loaded, whichever field changed (the kinds' own fingerprints cover only
what later stages compare). Artifacts written before it (2026-11-29) load without that check.

Example::

    save_artifact(out_dir, "profile", tensors={"freq": freq}, meta={"kind": "profile", ...})
    tensors, meta = load_artifact(out_dir, "profile", kind="profile", schema_version=2)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ArtifactError

if TYPE_CHECKING:  # torch and safetensors load with the first artifact, not with ``tandem --help``
    import torch


def umask_mode(mode: int) -> int:
    """``mode`` less the process umask: what open() and mkdir() give a new file or folder (mkstemp and mkdtemp
    make theirs private, 0600 / 0700, which an artifact renamed into place would otherwise keep)."""
    try:  # Linux says it without changing it (os.umask must set one to read it: another thread could see 0)
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return mode & ~umask


CHECKSUM_KEY = "content_sha256"


def content_checksum(meta: dict[str, Any], tensor_path: Path) -> str:
    """sha256 over the metadata (canonical JSON, without the checksum itself) and the tensor file's bytes (read in
    pieces: a large predictor set is not held twice in memory)."""
    plain = json.loads(json.dumps({k: v for k, v in meta.items() if k != CHECKSUM_KEY}))  # as the file reads back
    body = json.dumps(plain, sort_keys=True, separators=(",", ":"))  # (tuples as lists, int keys as strings)
    h = hashlib.sha256(body.encode())
    with open(tensor_path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def check_file_out(path: str | os.PathLike) -> Path:
    """Fail fast, before any work, where ``atomic_write_bytes(path, ...)`` could not write: ``path`` a folder,
    or its nearest existing ancestor not a writable folder. Returns ``path``."""
    path = Path(path)
    if path.is_dir():
        raise ArtifactError(f"cannot write {path}: it is a folder")
    _check_parent_writable(path)
    return path


def check_artifact_out(out_dir: str | os.PathLike, name: str) -> Path:
    """Fail fast, before any work, where ``save_artifact(out_dir, name, ...)`` could not write, or would replace
    something that is not a ``name`` artifact (a file, or a non-empty folder without ``name.json``: the user's
    own files, which replacing the folder would delete). Returns ``out_dir``."""
    out_dir = Path(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise ArtifactError(f"cannot write the {name} artifact to {out_dir}: a file is there")
        if out_dir.resolve() == Path.cwd().resolve():
            raise ArtifactError(f"cannot write the {name} artifact to {out_dir}: it is the current folder")
        if not (out_dir / f"{name}.json").is_file() and any(out_dir.iterdir()):
            raise ArtifactError(f"{out_dir} holds other files and no {name} artifact ({name}.json): writing the "
                                f"artifact there would delete them; choose another folder")
        others = sorted(p.name for p in out_dir.iterdir() if not _artifact_own(p.name, name))
        if others:  # an artifact's folder that also holds the user's files (or prepare's nested artifacts)
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            raise ArtifactError(f"{out_dir} holds the {name} artifact and other files ({shown}): writing the artifact "
                                f"there would delete them; move them or choose another folder")
    _check_parent_writable(out_dir)
    return out_dir


def _artifact_own(entry: str, name: str) -> bool:
    """Whether a folder entry is the ``name`` artifact's own: its files (``name.*``, e.g. the profile's plot) and
    the prepared-step cache written beside it (``step-cache``), which a new artifact replaces."""
    return entry.startswith(f"{name}.") or entry == "step-cache"


def _check_parent_writable(path: Path) -> None:
    """A temporary folder made and removed in the nearest existing ancestor of ``path`` (where the atomic
    writers make theirs): the one test of writability that holds for every user and file system."""
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ArtifactError(f"cannot write {path}: {parent} is not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tandem-write-check.", dir=parent))
    except OSError as e:
        raise ArtifactError(f"cannot write {path}: {e.strerror or e} in {parent}") from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), umask_mode(0o666))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def fingerprint(obj: Any) -> str:
    """Stable short hash of a JSON-serialisable object (sorted keys)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def save_file(tensors: dict[str, torch.Tensor], path: str) -> None:
    """safetensors' writer, imported on first use (torch loads with the first artifact, not with the CLI)."""
    from safetensors.torch import save_file as write
    write(tensors, path)


def load_file(path: str) -> dict[str, torch.Tensor]:
    """safetensors' reader, imported on first use."""
    from safetensors.torch import load_file as read
    return read(path)


def save_artifact(out_dir: str | os.PathLike, name: str, tensors: dict[str, torch.Tensor],
                  meta: dict[str, Any], extra_files: dict[str, bytes] | None = None) -> Path:
    """Write ``out_dir/name.safetensors`` + ``out_dir/name.json`` (+ extra files) atomically.

    The whole directory is replaced in one rename; files of an older artifact are dropped. A folder that is
    not a ``name`` artifact, or a file, is never replaced (``check_artifact_out``).
    """
    out_dir = check_artifact_out(out_dir, name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(contiguous, str(tmp_dir / f"{name}.safetensors"))
        meta = {**meta, CHECKSUM_KEY: content_checksum(meta, tmp_dir / f"{name}.safetensors")}
        (tmp_dir / f"{name}.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for fname, data in (extra_files or {}).items():
            (tmp_dir / fname).write_bytes(data)
        for child in tmp_dir.iterdir():
            child.chmod(umask_mode(0o666))
        tmp_dir.chmod(umask_mode(0o777))
        old_dir = None
        if out_dir.exists():
            old_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old_dir / "x")
        os.replace(tmp_dir, out_dir)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def load_artifact(art_dir: str | os.PathLike, name: str, kind: str,
                  schema_version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load and validate an artifact pair; every problem is an ArtifactError with one clear line."""
    from safetensors import SafetensorError

    art_dir = Path(art_dir)
    meta_path, tensor_path = art_dir / f"{name}.json", art_dir / f"{name}.safetensors"
    if not art_dir.is_dir():
        raise ArtifactError(f"{kind} directory not found: {art_dir}")
    if not meta_path.is_file() or not tensor_path.is_file():
        raise ArtifactError(f"{art_dir} is not a {kind} artifact (expected {name}.json and {name}.safetensors)")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"corrupted {kind} metadata {meta_path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("kind") != kind:
        raise ArtifactError(f"{meta_path} is not a {kind} artifact (kind={meta.get('kind') if isinstance(meta, dict) else None!r})")
    if meta.get("schema_version") != schema_version:
        raise ArtifactError(f"{meta_path} has schema version {meta.get('schema_version')}, this Tandem reads {schema_version}; rebuild it")
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"corrupted {kind} tensors {tensor_path}: {str(e).splitlines()[0]}") from None
    if CHECKSUM_KEY in meta and meta[CHECKSUM_KEY] != content_checksum(meta, tensor_path):
        raise ArtifactError(f"{kind} in {art_dir} is corrupted or was edited: its content does not match its "
                            f"checksum ({CHECKSUM_KEY}); make it again")
    return tensors, meta
