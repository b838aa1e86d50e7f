"""The snapshot format: safetensors + JSON, a manifest written last, never a pickle.

snapshots/step-000400/
  tensors.safetensors   model state, optimizer tensors (never downcast)
  batches.safetensors   the batches of steps 400.. (optional; written when the interval closes)
  state.json            step, RNG streams, optimizer/scheduler/scaler state, data position, versions
  MANIFEST.json         written LAST: files, sizes, sha256; no manifest = incomplete
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replaybisect.errors import SnapshotError

FORMAT = "replaybisect-snapshot/1"
SNAPSHOTS = "snapshots"
TENSORS = "tensors.safetensors"
BATCHES = "batches.safetensors"
STATE = "state.json"
MANIFEST = "MANIFEST.json"
ALLOWED_FILES = {TENSORS, BATCHES, STATE}
STEP_DIR = re.compile(r"^step-(\d{6,})$")
PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")  # pickle protocols, torch zip


def folder_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None


# ---- writing (called from the recorder's background worker) ------------------------------
def _writer_identity() -> str:
    """This process's host and PID namespace: a PID means something only inside both."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    try:
        return f"{host}_{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return host


WRITER = _writer_identity()
TEMP_NAME = re.compile(r"^\..+\.tmp-(?:(?P<writer>[A-Za-z0-9._]+)-)?(?P<pid>\d+)$")  # also the older `.NAME.tmp-PID`
STALE_FOREIGN_TEMP_SECONDS = 3600  # a temp of another host untouched this long belongs to a dead writer


def temp_path(path: Path) -> Path:
    """`.NAME.tmp-WRITER-PID` beside `path`: readers skip dot files; the next start removes a dead writer's."""
    return path.with_name(f".{path.name}.tmp-{WRITER}-{os.getpid()}")


@contextmanager
def _atomic_temp(path: Path):
    """Yield a temp path; on success it is renamed to `path`, on any failure (a full disk, Ctrl-C) removed."""
    temp = temp_path(path)
    try:
        yield temp
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, payload: bytes) -> dict[str, Any]:
    """Temp name, fsync, rename: a reader sees the whole file or none of it."""
    with _atomic_temp(path) as temp, open(temp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    return {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        pass
    return True


def is_stale_temp(path: Path, now: float) -> bool:
    """A temp file whose writer is dead: written here (same host and PID namespace) by a PID that is gone,
    or written elsewhere and untouched for an hour. A live writer's temp is never stale."""
    match = TEMP_NAME.match(path.name)
    if match is None:
        return False
    if match["writer"] == WRITER:
        return not _pid_alive(int(match["pid"]))
    try:
        return now - path.lstat().st_mtime > STALE_FOREIGN_TEMP_SECONDS
    except FileNotFoundError:
        return False


def remove_stale_temps(snapshots_root: Path) -> list[Path]:
    """Remove the temp files dead writers left in `snapshots_root/step-*/`; the removed paths."""
    import time

    now = time.time()
    removed = []
    for path in snapshots_root.glob("step-*/.*.tmp-*"):
        if is_stale_temp(path, now):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def write_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """A safetensors file streamed from the tensors' own memory: no whole-file copy in RAM and the GIL is
    released while bytes move (`safetensors.torch.save` builds the file as one bytes object first, which on
    2 cores costs the training step more than the write). The safetensors library reads it back."""
    if any(t.dtype not in SAFETENSORS_DTYPES for t in tensors.values()):
        return write_atomic(path, encode_tensors(tensors, metadata))
    names = sorted(tensors)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format pads the header to 8 bytes
    digest = hashlib.sha256()
    with _atomic_temp(path) as temp, open(temp, "wb") as handle:
        for chunk in (len(header_bytes).to_bytes(8, "little"), header_bytes):
            handle.write(chunk)
            digest.update(chunk)
        for name in names:
            data = memoryview(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            handle.write(data)
            digest.update(data)
        handle.flush()
        os.fsync(handle.fileno())
    return {"size": 8 + len(header_bytes) + offset, "sha256": digest.hexdigest()}


def fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def encode_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata=metadata)


def encode_json(data: dict) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode("utf-8")


def write_manifest(folder: Path, step: int, files: dict[str, dict]) -> None:
    manifest = {"format": FORMAT, "step": step, "files": files}
    write_atomic(folder / MANIFEST, encode_json(manifest))
    fsync_dir(folder)


def flatten_batch(step: int, batch) -> tuple[dict[str, torch.Tensor], Any]:
    """A batch (tensor, tuple/list of tensors, or dict of tensors) as named tensors + its structure."""
    if isinstance(batch, torch.Tensor):
        return {f"{step}/_": batch}, "tensor"
    if isinstance(batch, dict):
        return {f"{step}/{key}": value for key, value in batch.items()}, {"dict": list(batch)}
    return {f"{step}/{index}": value for index, value in enumerate(batch)}, {"tuple": len(batch)}


def unflatten_batch(step: int, tensors: dict[str, torch.Tensor], structure):
    if structure == "tensor":
        return tensors[f"{step}/_"]
    if "dict" in structure:
        return {key: tensors[f"{step}/{key}"] for key in structure["dict"]}
    return tuple(tensors[f"{step}/{index}"] for index in range(structure["tuple"]))


def encode_batches(batches: dict[int, Any]) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    structure: dict[str, Any] = {}
    for step, batch in batches.items():
        named, shape = flatten_batch(step, batch)
        tensors.update({key: value.detach().cpu().contiguous() for key, value in named.items()})
        structure[str(step)] = shape
    return encode_tensors(tensors, {"structure": json.dumps(structure)})


# ---- reading ----------------------------------------------------------------------------------
@dataclass
class Snapshot:
    step: int
    folder: Path
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    batches: dict[int, Any]


def _refuse_pickles(folder: Path) -> None:
    """Only the format's own files may be present; a pickle (or torch.save zip) is never opened."""
    for path in sorted(folder.iterdir()):
        if path.name == MANIFEST or path.name.startswith("."):  # dot files: temp names of an interrupted write
            continue
        if path.name not in ALLOWED_FILES:
            raise SnapshotError(
                f"snapshot {folder.name} holds {path.name}, which is not part of the snapshot format; refusing to load it "
                "(replaybisect never unpickles); remove the file or use another snapshot"
            )
        if path.suffix == ".safetensors":
            with open(path, "rb") as handle:
                if handle.read(4).startswith(PICKLE_MAGIC):
                    raise SnapshotError(
                        f"snapshot {folder.name}: {path.name} is a pickle, not safetensors; refusing to load it (pickles can run code)"
                    )


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise SnapshotError(f"snapshot {folder.name} is incomplete (no {MANIFEST}: its write was interrupted)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise SnapshotError(f"snapshot {folder.name}: {MANIFEST} is unreadable (interrupted or corrupt)") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise SnapshotError(f"snapshot {folder.name}: {MANIFEST} is not a {FORMAT} manifest")
    unknown = set(manifest["files"]) - ALLOWED_FILES
    if unknown:
        raise SnapshotError(f"snapshot {folder.name}: manifest lists {sorted(unknown)}, not part of the format; refusing to load")
    return manifest


def read_verified(folder: Path, name: str, manifest: dict[str, Any]) -> bytes:
    entry = manifest["files"].get(name)
    if entry is None:
        raise SnapshotError(f"snapshot {folder.name}: {name} is not in its manifest")
    path = folder / name
    if not path.is_file():
        raise SnapshotError(f"snapshot {folder.name}: {name} is missing")
    payload = path.read_bytes()
    if len(payload) != entry["size"] or hashlib.sha256(payload).hexdigest() != entry["sha256"]:
        raise SnapshotError(f"snapshot {folder.name}: {name} fails verification (checksum mismatch: the file is corrupt)")
    return payload


def verify(folder: Path) -> dict[str, Any]:
    """Check the manifest and every file's size and sha256; return the manifest."""
    _refuse_pickles(folder)
    manifest = read_manifest(folder)
    for name in manifest["files"]:
        read_verified(folder, name, manifest)
    return manifest


def load(folder: Path) -> Snapshot:
    """Verify and load a snapshot folder (safetensors and JSON only)."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_tensors

    _refuse_pickles(folder)
    manifest = read_manifest(folder)
    try:
        state = json.loads(read_verified(folder, STATE, manifest))
        tensors = load_tensors(read_verified(folder, TENSORS, manifest))
        batches: dict[int, Any] = {}
        if BATCHES in manifest["files"]:
            payload = read_verified(folder, BATCHES, manifest)
            batch_tensors = load_tensors(payload)
            structure = json.loads(_safetensors_metadata(payload).get("structure", "{}"))
            batches = {int(step): unflatten_batch(int(step), batch_tensors, shape) for step, shape in structure.items()}
    except (SafetensorError, ValueError) as error:
        raise SnapshotError(f"snapshot {folder.name} is unreadable: {error}") from None
    return Snapshot(step=int(manifest["step"]), folder=folder, tensors=tensors, state=state, batches=batches)


def _safetensors_metadata(payload: bytes) -> dict[str, str]:
    header_size = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + header_size])
    return header.get("__metadata__", {})
