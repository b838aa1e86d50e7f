"""The snapshot format: safetensors + JSON, a manifest written last, never a pickle.

snapshots/step-000400/
  tensors.safetensors   model state, optimizer tensors (never downcast)
  batches.safetensors   the batches of steps 400.. (optional; written when the interval closes)
  grads.safetensors     the gradients step 400 began with, where the loop had not cleared them (optional)
  state.json            step, RNG streams, optimizer/scheduler/scaler state, data position, versions
  MANIFEST.json         written LAST: files, sizes, BLAKE3 hashes (sha256 in older runs); no manifest = incomplete
"""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
import itertools
import json
import keyword
import math
import os
import re
import stat
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

import torch
from blake3 import blake3 as _blake3
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from replaybisect.core.state import GRAD_PREFIX, check_state, schema_error
from replaybisect.errors import SnapshotError

FORMAT = "replaybisect-snapshot/2"  # what this version writes: each file's BLAKE3 hash in the manifest
FORMAT_SHA256 = "replaybisect-snapshot/1"  # what versions before 2026-12-06 wrote (sha256): still read
SNAPSHOTS = "snapshots"
TENSORS = "tensors.safetensors"
BATCHES = "batches.safetensors"
STATE = "state.json"
MANIFEST = "MANIFEST.json"
GRADS = "grads.safetensors"  # the gradients a step began with, where its loop had not cleared them (optional)
ALLOWED_FILES = {TENSORS, BATCHES, STATE, GRADS}
STEP_DIR = re.compile(r"^step-(\d{6,})$")


def snapshot_due(step: int, every: int) -> bool:
    """Whether a periodic snapshot is taken as `step` opens (every=0: none)."""
    return bool(every) and step % every == 0


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
    with _atomic_temp(path) as temp:
        _write_synced(temp, [payload])
    return file_entry(payload)


def file_entry(payload: bytes) -> dict[str, Any]:
    """The manifest entry of a file holding `payload`."""
    return _entry_hashed(len(payload), _blake3(payload))


def _entry_hashed(size: int, digest: _blake3) -> dict[str, Any]:
    """A file's manifest entry from its size and the BLAKE3 hasher that saw its bytes. BLAKE3, not sha256: the writer
    thread hashes every snapshot on a core the training threads want, 30 ms per 100 MB here against sha256's 67 (on a
    CPU with the SHA extensions)."""
    return {"size": size, "blake3": digest.hexdigest()}


WRITE_SLICE = 1 << 16  # bytes a write() through the page cache: a new file written 3.3 MB in 64 KiB writes took 1 ms of
# CPU here, in writes of 128 KiB or more about 20 ms


def _write_synced(path: Path, chunks: Iterable) -> None:
    """`chunks` (bytes-like) written to `path` in turn, in slices of at most WRITE_SLICE, then fsynced."""
    with open(path, "wb") as handle:
        for chunk in chunks:
            view = memoryview(chunk)
            for start in range(0, len(view), WRITE_SLICE):
                handle.write(view[start:start + WRITE_SLICE])
        handle.flush()
        os.fsync(handle.fileno())


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


SMALL_TENSOR = 1 << 16  # bytes: smaller tensors of one dtype are written joined (a snapshot's batches: thousands of them)
JOINED = 1 << 22  # bytes at most in one joined chunk (its copy)


def write_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """A safetensors file streamed from the tensors' own memory: no whole-file copy in RAM and the GIL is
    released while bytes move (`safetensors.torch.save` builds the file as one bytes object first, which on
    2 cores costs the training step more than the write). A run of small tensors of one dtype is joined in one call
    and written as one chunk: a write and a hash update per tensor, in Python, held the GIL the training thread needs
    for ~15 ms per snapshot of 100 steps' batches. The safetensors library reads it back."""
    layout = TensorsImage.layout_of(list(tensors.items()))
    if layout is None:
        return write_atomic(path, encode_tensors(_unshared(tensors), metadata))
    head, _, data_bytes = _safetensors_head(layout, metadata)
    digest = _blake3(head)

    def hashed_data():
        for chunk in _chunks([tensors[name].detach() for name, _, _ in layout]):
            data = memoryview(chunk.reshape(-1).view(torch.uint8).numpy())
            digest.update(data)
            yield data

    with _atomic_temp(path) as temp:
        _write_synced(temp, itertools.chain([head], hashed_data()))
    return _entry_hashed(len(head) + data_bytes, digest)


def _chunks(tensors: list[torch.Tensor]):
    """The tensors' bytes in order, as tensors: a large one as it is (contiguous), runs of small ones of one dtype
    flattened together (copied: at most JOINED bytes a run)."""
    run: list[torch.Tensor] = []
    joined = 0
    for tensor in tensors:
        if run and (tensor.dtype != run[0].dtype or tensor.nbytes >= SMALL_TENSOR or joined + tensor.nbytes > JOINED):
            yield torch._utils._flatten_dense_tensors(run)
            run, joined = [], 0
        if tensor.nbytes >= SMALL_TENSOR:
            yield tensor.contiguous()
        else:
            run.append(tensor)
            joined += tensor.nbytes
    if run:
        yield torch._utils._flatten_dense_tensors(run)


def _safetensors_head(layout, metadata: dict[str, str] | None = None, align: int = 8) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """A safetensors file's head for tensors (name, shape, dtype) stored in this order: the 8-byte header length and the
    JSON header, padded with spaces (the format allows them) so that the data starts at a multiple of `align`; each
    tensor's byte range in the data; the data's size."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    spans, offset = {}, 0
    for name, shape, dtype in layout:
        spans[name] = (offset, offset + math.prod(shape) * dtype.itemsize)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": list(spans[name])}
        offset = spans[name][1]
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-(8 + len(header_bytes)) % align)
    return len(header_bytes).to_bytes(8, "little") + header_bytes, spans, offset


PAGE = 4096  # O_DIRECT's alignment of memory, file offset and length (the logical block size is at most this)
DIRECT_CHUNK = 64 * 2**20  # one write() stays far below Linux's 2 GiB cap


class TensorsImage:
    """A safetensors file laid out in one page-aligned host buffer: its header, padded with spaces to a page, then
    every tensor's bytes. A snapshot copies the state into `views` and the writer writes the buffer as it is, with
    O_DIRECT where the file system takes it: the bytes go from this buffer to the disk without the page cache, whose
    copying in `write()` cost the training threads 2.7 ms of step time per MB on 2 cores (benchmarks/snapshot_stall.py).
    Tensors are placed by element size, largest first, so each view is aligned for its dtype."""

    def __init__(self, layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...], pin: bool = False):
        self.layout = layout
        head, spans, self.data_bytes = _safetensors_head(layout, align=PAGE)
        self.size = len(head) + self.data_bytes
        allocated = self.size + (-self.size % PAGE)
        raw = torch.empty(allocated + PAGE, dtype=torch.uint8, pin_memory=pin)
        start = -raw.data_ptr() % PAGE
        self.buffer = raw[start:start + allocated]
        self.buffer[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        self.buffer[self.size:].zero_()
        self.views: dict[str, torch.Tensor] = {
            name: self.buffer[len(head) + spans[name][0]:len(head) + spans[name][1]].view(dtype).view(shape)
            for name, shape, dtype in layout}

    @staticmethod
    def layout_of(tensors: list[tuple[str, torch.Tensor]]) -> tuple | None:
        """The layout of these (name, tensor) pairs, largest element first (each aligned for its dtype), each dtype's
        together (write_tensors_atomic joins a run of small ones), by name within it; None where a dtype has no
        safetensors name this writer knows (such a state is written by `encode_tensors`)."""
        if any(tensor.dtype not in SAFETENSORS_DTYPES for _, tensor in tensors):
            return None
        ordered = sorted(tensors, key=lambda item: (-item[1].dtype.itemsize, SAFETENSORS_DTYPES[item[1].dtype], item[0]))
        return tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in ordered)

    def write_atomic(self, path: Path) -> dict[str, Any]:
        """The file at `path` (temp name, fsync, rename), written straight from the buffer where O_DIRECT works here,
        else through the page cache."""
        data = memoryview(self.buffer.numpy())
        digest = _blake3(data[:self.size])
        with _atomic_temp(path) as temp:
            if not _write_direct(temp, data, self.size):
                _write_synced(temp, [data[:self.size]])
        return _entry_hashed(self.size, digest)


def _write_direct(path: Path, data: memoryview, size: int) -> bool:
    """Write `data` (page-aligned, a whole number of pages) to `path` with O_DIRECT, cut to `size` and fsynced; False
    where the file system refuses O_DIRECT (tmpfs, some network and FUSE file systems), with nothing left to undo."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o666)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    try:
        written = 0
        while written < len(data):
            written += os.write(descriptor, data[written:written + DIRECT_CHUNK])
        os.ftruncate(descriptor, size)
        os.fsync(descriptor)
    except OSError as error:
        if error.errno == errno.EINVAL:  # opened, but this write's alignment is not the device's: written again
            return False
        raise
    finally:
        os.close(descriptor)
    return True


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
    """A batch as named tensors + its structure: a tensor, a tuple/list or dict of tensors (the flat shapes
    `replay train` writes), or any nesting of lists, tuples and dicts of tensors and JSON scalars (a "tree":
    micro-batches of a user's loop, a batch with its RNG state)."""
    if isinstance(batch, torch.Tensor):
        return {f"{step}/_": batch}, "tensor"
    if isinstance(batch, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in batch.items()):
        return {f"{step}/{key}": value for key, value in batch.items()}, {"dict": list(batch)}
    if type(batch) in (list, tuple) and all(isinstance(v, torch.Tensor) for v in batch):  # a namedtuple goes in a tree
        return {f"{step}/{index}": value for index, value in enumerate(batch)}, {"tuple": len(batch)}
    tensors: dict[str, torch.Tensor] = {}
    return tensors, {"tree": _tree_of(batch, step, tensors, depth=0)}


MAX_TREE_DEPTH = 16
MAX_TREE_NODES = 100_000


def _tree_of(value: Any, step: int, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    """One node of a tree structure: {"t": n} a tensor, {"list"|"tuple": [...]}, {"dict": [[key, node], ...]},
    {"namedtuple": {"name", "fields", "items"}}, {"v": scalar}. Tensors are named <step>/<n> in order."""
    if depth > MAX_TREE_DEPTH:
        raise ValueError(f"a batch nested deeper than {MAX_TREE_DEPTH} levels cannot be stored")
    if isinstance(value, torch.Tensor):
        tensors[f"{step}/{len(tensors)}"] = value
        return {"t": len(tensors) - 1}
    if isinstance(value, dict):
        return {"dict": [[str(k), _tree_of(v, step, tensors, depth + 1)] for k, v in value.items()]}
    if is_namedtuple(value) and storable_namedtuple(value):  # by name and fields: rebuilt as an equivalent type, importing nothing
        return {"namedtuple": {"name": type(value).__name__, "fields": list(value._fields),
                               "items": [_tree_of(v, step, tensors, depth + 1) for v in value]}}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__ if type(value) in (list, tuple) else "tuple": [_tree_of(v, step, tensors, depth + 1) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    raise TypeError(f"a batch holding a {type(value).__name__} cannot be stored: use tensors, lists, tuples, dicts and numbers")


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple)


def storable_namedtuple(value: tuple) -> bool:
    """A namedtuple whose name and fields a snapshot can hold (see _namedtuple_spec_ok), e.g. not pandas' `_1`."""
    return _namedtuple_spec_ok({"name": type(value).__name__, "fields": list(value._fields), "items": list(value)})


def like(sequence: list | tuple, items) -> list | tuple:
    """`items` in a sequence of the same kind as `sequence`: a list, a tuple, the same namedtuple (`_make`: no
    constructor of a subclass runs again); any other list or tuple subclass becomes a plain tuple, as stored."""
    if is_namedtuple(sequence):
        return type(sequence)._make(items)
    return type(sequence)(items) if type(sequence) in (list, tuple) else tuple(items)


@functools.lru_cache(maxsize=256)
def _namedtuple_type(name: str, fields: tuple[str, ...]):
    return collections.namedtuple(name, fields)


def _from_tree(node: Any, step: int, tensors: dict[str, torch.Tensor]) -> Any:
    if "t" in node:
        return tensors[f"{step}/{node['t']}"]
    if "namedtuple" in node:
        spec = node["namedtuple"]
        return _namedtuple_type(spec["name"], tuple(spec["fields"]))(*(_from_tree(child, step, tensors) for child in spec["items"]))
    if "dict" in node:
        return {key: _from_tree(child, step, tensors) for key, child in node["dict"]}
    if "list" in node:
        return [_from_tree(child, step, tensors) for child in node["list"]]
    if "tuple" in node:
        return tuple(_from_tree(child, step, tensors) for child in node["tuple"])
    return node["v"]


def _tree_tensor_names(node: Any, step: int, names: list[str], depth: int = 0) -> bool:
    """Collect the tensor names a tree refers to; False when it is not a well-formed tree."""
    if depth > MAX_TREE_DEPTH or not isinstance(node, dict) or len(node) != 1 or len(names) > MAX_TREE_NODES:
        return False
    (kind, value), = node.items()
    if kind == "t":
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TREE_NODES:
            return False
        names.append(f"{step}/{value}")
        return True
    if kind in ("list", "tuple"):
        return isinstance(value, list) and all(_tree_tensor_names(child, step, names, depth + 1) for child in value)
    if kind == "namedtuple":
        return (isinstance(value, dict) and set(value) == {"name", "fields", "items"} and _namedtuple_spec_ok(value)
                and all(_tree_tensor_names(child, step, names, depth + 1) for child in value["items"]))
    if kind == "dict":
        return isinstance(value, list) and all(
            isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and _tree_tensor_names(pair[1], step, names, depth + 1)
            for pair in value
        )
    return kind == "v" and (value is None or isinstance(value, (bool, int, float, str)))


def _namedtuple_spec_ok(spec: dict) -> bool:
    """A name and fields collections.namedtuple accepts (ASCII: no two names that Python reads as one), as many
    fields as items, within bounds."""
    name, fields, items = spec["name"], spec["fields"], spec["items"]
    if not (isinstance(name, str) and isinstance(fields, list) and isinstance(items, list) and len(fields) == len(items) <= 1000):
        return False
    words = [name, *fields]
    return (all(isinstance(w, str) and w.isascii() and w.isidentifier() and not keyword.iskeyword(w) and len(w) <= 200 for w in words)
            and not any(field.startswith("_") for field in fields) and len(set(fields)) == len(fields))


def unflatten_batch(step: int, tensors: dict[str, torch.Tensor], structure):
    if structure == "tensor":
        return tensors[f"{step}/_"]
    if "tree" in structure:
        return _from_tree(structure["tree"], step, tensors)
    if "dict" in structure:
        return {key: tensors[f"{step}/{key}"] for key in structure["dict"]}
    return tuple(tensors[f"{step}/{index}"] for index in range(structure["tuple"]))


def encode_batches(batches: dict[int, Any]) -> bytes:
    """The batches file as bytes (sent between a job's processes: core/ranks.py)."""
    tensors, metadata = _batch_tensors(batches)
    return encode_tensors(_unshared(tensors), metadata)


def write_batches_atomic(path: Path, batches: dict[int, Any]) -> dict[str, Any]:
    """The batches file, streamed (write_tensors_atomic): no copy of the whole file made first, and each run of small
    tensors written as one chunk, not one write and hash update a tensor, work the writer would do holding the GIL the
    training thread needs."""
    tensors, metadata = _batch_tensors(batches)
    return write_tensors_atomic(path, tensors, metadata)


def _batch_tensors(batches: dict[int, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    structure: dict[str, Any] = {}
    for step, batch in batches.items():
        named, shape = flatten_batch(step, batch)
        tensors.update({key: value.detach().cpu() for key, value in named.items()})
        structure[str(step)] = shape
    return tensors, {"structure": json.dumps(structure)}


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies: micro-batches are often views of one tensor, and safetensors' encoder refuses tensors that share memory."""
    return {name: tensor.to("cpu", copy=True).contiguous() for name, tensor in tensors.items()}


# ---- reading ----------------------------------------------------------------------------------
# Everything read here may have been written by someone else: each file is parsed as what it claims to be
# (safetensors by its own layout, JSON by a schema), nothing is ever unpickled, and any flaw is a SnapshotError.
MAX_MANIFEST_BYTES = 1 << 20
MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own limit
SAFETENSORS_ITEM_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
TENSOR_NAME = re.compile(r"^(model/.+|optim/\d{1,9}/.+|optim/own/(?!\d+\Z)[^\n]{1,200})\Z")
BATCH_STEP = re.compile(r"^\d{1,12}$")


HEX_DIGEST = r"^[0-9a-f]{64}$"


class Blake3Entry(BaseModel):
    """A file of a snapshot of FORMAT: its size and BLAKE3 hash."""
    model_config = ConfigDict(extra="forbid", strict=True)
    size: int = Field(ge=0)
    blake3: str = Field(pattern=HEX_DIGEST)

    def matches(self, payload: bytes) -> bool:
        return _blake3(payload).hexdigest() == self.blake3


class Sha256Entry(BaseModel):
    """A file of a snapshot of FORMAT_SHA256: its size and sha256."""
    model_config = ConfigDict(extra="forbid", strict=True)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=HEX_DIGEST)

    def matches(self, payload: bytes) -> bool:
        return hashlib.sha256(payload).hexdigest() == self.sha256


ENTRY_OF_FORMAT = {FORMAT: (Blake3Entry, "BLAKE3"), FORMAT_SHA256: (Sha256Entry, "sha256")}  # its entries, its hash


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: Literal[FORMAT, FORMAT_SHA256]
    step: int = Field(ge=0)
    files: dict[Literal[TENSORS, BATCHES, STATE, GRADS], Blake3Entry | Sha256Entry]

    @model_validator(mode="after")
    def _hashed_as_its_format_says(self) -> "Manifest":
        kind, hashed = ENTRY_OF_FORMAT[self.format]
        if not all(isinstance(entry, kind) for entry in self.files.values()):
            raise ValueError(f"a {self.format} manifest lists each file with its {hashed} hash, and only that")
        return self


@dataclass
class Snapshot:
    step: int
    folder: Path
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    batches: dict[int, Any]


def _bad(folder: Path, name: str, why: str) -> SnapshotError:
    return SnapshotError(f"snapshot {folder.name}: {name} {why}")


def _check_folder(folder: Path) -> None:
    """The folder and everything in it must be plain: no symlinks (checked before anything is opened), no
    special files, and only the format's own files (a pickle or torch.save file is never opened)."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        raise SnapshotError(f"snapshot {folder.name} is missing") from None
    if stat.S_ISLNK(info.st_mode):
        raise SnapshotError(f"snapshot {folder.name} is a symlink; refusing to follow it (a snapshot folder must be a plain folder)")
    if not stat.S_ISDIR(info.st_mode):
        raise SnapshotError(f"snapshot {folder.name} is not a folder")
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.is_symlink():
                raise _bad(folder, entry.name, "is a symlink; refusing to load the snapshot (remove the link)")
            if entry.name != MANIFEST and entry.name not in ALLOWED_FILES and not TEMP_NAME.match(entry.name):
                raise _bad(folder, entry.name, "is not part of the snapshot format; refusing to load the snapshot "
                                               "(replaybisect never unpickles); remove the file or use another snapshot")
            if not entry.is_file(follow_symlinks=False):
                raise _bad(folder, entry.name, "is not a regular file; refusing to load the snapshot")


def _read_plain_file(folder: Path, name: str, expected_size: int | None = None, max_size: int | None = None) -> bytes:
    """The bytes of a regular file, never through a symlink, never blocking on a FIFO."""
    try:
        descriptor = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _bad(folder, name, "is missing") from None
    except OSError as error:
        raise _bad(folder, name, f"cannot be opened ({error.strerror}); symlinks are refused") from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _bad(folder, name, "is not a regular file")
        if expected_size is not None and info.st_size != expected_size:
            raise _bad(folder, name, f"fails verification (size {info.st_size}, manifest says {expected_size}: the file is corrupt)")
        if max_size is not None and info.st_size > max_size:
            raise _bad(folder, name, f"is {info.st_size} bytes, more than a snapshot's {name} can be; refusing to read it")
        return handle.read()


def _parse_json(folder: Path, name: str, payload: bytes) -> Any:
    try:
        return json.loads(payload.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        why = "nests too deeply" if isinstance(error, RecursionError) else f"is not valid JSON ({str(error)[:80]})"
        raise _bad(folder, name, f"{why}: the file is corrupt") from None


def read_manifest(folder: Path) -> Manifest:
    if not os.path.lexists(folder / MANIFEST):
        raise SnapshotError(f"snapshot {folder.name} is incomplete (no {MANIFEST}: its write was interrupted)")
    data = _parse_json(folder, MANIFEST, _read_plain_file(folder, MANIFEST, max_size=MAX_MANIFEST_BYTES))
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as error:
        raise _bad(folder, MANIFEST, f"is not a {FORMAT} (or {FORMAT_SHA256}) manifest ({schema_error(error)})") from None
    for required in (TENSORS, STATE):
        if required not in manifest.files:
            raise _bad(folder, MANIFEST, f"does not list {required}")
    if manifest.step != step_of(folder.name):
        raise _bad(folder, MANIFEST, f"says step {manifest.step}, but the folder is {folder.name}")
    for name in sorted(ALLOWED_FILES - set(manifest.files)):
        if os.path.lexists(folder / name):
            raise _bad(folder, name, f"is not listed in {MANIFEST}; refusing a file the snapshot did not write")
    return manifest


def read_verified(folder: Path, name: str, manifest: Manifest) -> bytes:
    entry = manifest.files.get(name)
    if entry is None:
        raise _bad(folder, name, "is not in its manifest")
    payload = _read_plain_file(folder, name, expected_size=entry.size)
    if not entry.matches(payload):
        raise _bad(folder, name, "fails verification (checksum mismatch: the file is corrupt)")
    return payload


def verify(folder: Path) -> Manifest:
    """Check the folder, the manifest and every file's size and hash; return the manifest."""
    _check_folder(folder)
    manifest = read_manifest(folder)
    for name in manifest.files:
        read_verified(folder, name, manifest)
    return manifest


def safetensors_layout(payload: bytes) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Parse a safetensors file's layout: 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte range, and the ranges tiling the data exactly. Returns (entries, metadata);
    raises ValueError saying why the bytes are not safetensors (a pickle, a truncated file, ...)."""
    if len(payload) < 8:
        raise ValueError(f"{len(payload)} bytes, shorter than the 8-byte header length")
    header_size = int.from_bytes(payload[:8], "little")
    if header_size > min(len(payload) - 8, MAX_SAFETENSORS_HEADER):
        raise ValueError(f"its header length {header_size} runs past the end of the {len(payload)}-byte file")
    try:
        header = json.loads(payload[8 : 8 + header_size].decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValueError("its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("its __metadata__ is not an object of strings")
    spans = sorted((_tensor_span(name, entry), name) for name, entry in header.items())
    cursor = 0
    for (begin, end), name in spans:
        if begin != cursor:
            raise ValueError(f"tensor {name!r} starts at byte {begin}, not {cursor} (gap or overlap)")
        cursor = end
    if cursor != len(payload) - 8 - header_size:
        raise ValueError(f"its tensors cover {cursor} bytes of a {len(payload) - 8 - header_size}-byte buffer")
    return header, metadata


def _tensor_span(name: str, entry: Any) -> tuple[int, int]:
    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name!r} is not described by dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEM_SIZES:
        raise ValueError(f"tensor {name!r} has unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or not all(is_int(d) for d in shape):
        raise ValueError(f"tensor {name!r} has a shape that is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets) or offsets[0] > offsets[1]:
        raise ValueError(f"tensor {name!r} has data_offsets that are not [begin, end]")
    if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_ITEM_SIZES[dtype]:
        raise ValueError(f"tensor {name!r}: its byte range does not match its dtype and shape")
    return offsets[0], offsets[1]


def _load_safetensors(folder: Path, name: str, payload: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError
    from safetensors.torch import load as load_tensors

    try:
        _, metadata = safetensors_layout(payload)
        return load_tensors(payload), metadata
    except (ValueError, SafetensorError) as error:
        raise _bad(folder, name, f"is not a valid safetensors file ({error}); refusing to load it (replaybisect never unpickles)") from None


def _check_tensor_names(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    for name in tensors:
        if not TENSOR_NAME.match(name):
            raise _bad(folder, TENSORS, f"holds tensor {name[:60]!r}, which is neither model/... nor optim/<index>/... nor optim/own/...")


def _batches(folder: Path, step: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[int, Any]:
    """The batches from the file's `structure` metadata, which must name exactly the tensors the file holds."""
    def bad(why: str) -> SnapshotError:
        return _bad(folder, BATCHES, f"has unusable structure metadata ({why})")

    if "structure" not in metadata:
        raise bad("missing")
    try:
        structure = json.loads(metadata["structure"])
    except (ValueError, RecursionError):
        raise bad("not valid JSON") from None
    if not isinstance(structure, dict):
        raise bad("not an object")
    batches: dict[int, Any] = {}
    used: set[str] = set()
    for key, shape in structure.items():
        if not BATCH_STEP.match(key) or int(key) < step:
            raise bad(f"step {key[:20]!r} is not a step at or after {step}")
        names = _batch_tensor_names(int(key), shape)
        if names is None:
            raise bad(f"the batch of step {key} has an unknown shape")
        absent = [name for name in names if name not in tensors]
        if absent or len(set(names)) != len(names):
            raise bad(f"the batch of step {key} names absent or repeated tensors {absent[:3]}")
        used.update(names)
        batches[int(key)] = unflatten_batch(int(key), tensors, shape)
    if used != set(tensors):
        raise bad(f"{len(set(tensors) - used)} tensor(s) belong to no batch")
    return batches


def _batch_tensor_names(step: int, shape: Any) -> list[str] | None:
    """The tensor names a batch structure refers to (see flatten_batch); None when it is not one."""
    if shape == "tensor":
        return [f"{step}/_"]
    if isinstance(shape, dict) and len(shape) == 1:
        keys, count = shape.get("dict"), shape.get("tuple")
        if isinstance(keys, list) and all(isinstance(k, str) for k in keys):
            return [f"{step}/{k}" for k in keys]
        if isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= 10_000:
            return [f"{step}/{i}" for i in range(count)]
        names: list[str] = []
        if "tree" in shape and _tree_tensor_names(shape["tree"], step, names):
            return names
    return None


def decode_batches(payload: bytes, source: str) -> dict[int, Any]:
    """Batches as encode_batches wrote them, sent by another process of the same job (`source` names it in errors)."""
    origin = Path(source)
    tensors, metadata = _load_safetensors(origin, BATCHES, payload)
    return _batches(origin, 0, tensors, metadata)


def load(folder: Path) -> Snapshot:
    """Verify and load a snapshot folder (safetensors and JSON only); any flaw is a SnapshotError."""
    _check_folder(folder)
    manifest = read_manifest(folder)
    state = _parse_json(folder, STATE, read_verified(folder, STATE, manifest))
    check_state(state, manifest.step, lambda why: _bad(folder, STATE, why))
    tensors, _ = _load_safetensors(folder, TENSORS, read_verified(folder, TENSORS, manifest))
    _check_tensor_names(folder, tensors)
    if GRADS in manifest.files:  # as grad/<parameter name>, beside model/<name>
        grads, _ = _load_safetensors(folder, GRADS, read_verified(folder, GRADS, manifest))
        tensors.update({f"{GRAD_PREFIX}{name}": tensor for name, tensor in grads.items()})
    batches: dict[int, Any] = {}
    if BATCHES in manifest.files:
        batch_tensors, metadata = _load_safetensors(folder, BATCHES, read_verified(folder, BATCHES, manifest))
        batches = _batches(folder, manifest.step, batch_tensors, metadata)
    return Snapshot(step=manifest.step, folder=folder, tensors=tensors, state=state, batches=batches)
