"""Tampered snapshots never crash: generated corruptions of a real snapshot folder (hypothesis).

One tiny run is trained in-process (snapshots at steps 0, 4 and 8). Each example corrupts a copy of the newest
snapshot, then checks the promise: loading raises nothing but SnapshotError (no other exception, no segfault, no
hang), and restoring puts the corrupt copy where the newest snapshot was and gets the previous good snapshot (step 4,
replayed exactly) unless the change left a snapshot that still loads and applies. The counts of cases tried and of
cases that met the promise are printed per area (run with -s to see them). `replay nan` on a tampered run:
e2e/test_snapshot_tampered.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import Workspace, resign
from replaybisect.errors import SnapshotError
from replaybisect.core import snapshot as fmt

NEWEST, PREVIOUS = 8, 4
TRIED: Counter = Counter()
MET: Counter = Counter()
SETTINGS = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from replaybisect.core import config as config_mod
    from replaybisect.verbs.train.engine import train

    workspace = Workspace(tmp_path_factory.mktemp("fuzz"))
    store = workspace.store()
    cfg = config_mod.compose(None, None, ["train.steps=12", "snapshot.every=4", "model.hidden=16", "train.val_every=0"])
    result = train(cfg, store)
    root = store.local_artifact_dir(result.run_id) / fmt.SNAPSHOTS
    assert sorted(p.name for p in root.iterdir()) == [fmt.folder_name(s) for s in (0, PREVIOUS, NEWEST)]
    yield store, result.run_id, cfg, root
    for area in sorted(TRIED):
        print(f"\nsnapshot fuzz {area}: {TRIED[area]} cases tried, {MET[area]} met the promise", file=sys.stderr)


# ---- corruptions: each takes the folder (a copy of the newest snapshot) and changes it -------------------------
FILES = [fmt.TENSORS, fmt.BATCHES, fmt.STATE, fmt.MANIFEST]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def byte_edits(draw):
    name = draw(st.sampled_from(FILES))
    kind = draw(st.sampled_from(["flip", "truncate", "extend"]))
    fraction = draw(st.floats(0, 1))
    xor = draw(st.integers(1, 255))
    tail = draw(st.binary(min_size=1, max_size=64))
    signed = draw(st.booleans()) and name != fmt.MANIFEST

    def corrupt(folder: Path) -> None:
        data = bytearray((folder / name).read_bytes())
        at = min(int(fraction * len(data)), len(data) - 1)
        if kind == "flip":
            data[at] ^= xor
        elif kind == "truncate":
            del data[at:]
        else:
            data += tail
        (folder / name).write_bytes(bytes(data))
        if signed:
            resign(folder, name)

    return f"{kind} {name} at {fraction:.2f}{' re-signed' if signed else ''}", corrupt


@st.composite
def header_edits(draw):
    """The 8-byte header length, or one field of the JSON header, of a safetensors file (re-signed)."""
    name = draw(st.sampled_from([fmt.TENSORS, fmt.BATCHES]))
    length = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(-64, 64), st.sampled_from([640, 896, 1152, 1408])))
    field = draw(st.sampled_from(["length", "dtype", "shape", "data_offsets", "entry", "structure", "metadata"]))
    value = draw(json_values)

    def corrupt(folder: Path) -> None:
        data = (folder / name).read_bytes()
        size = int.from_bytes(data[:8], "little")
        header, body = json.loads(data[8 : 8 + size]), data[8 + size :]
        if field == "length":
            data = ((size + length) % 2**64 if abs(length) <= 64 else length).to_bytes(8, "little") + data[8:]
        else:
            tensor = sorted(k for k in header if k != "__metadata__")[0]
            if field in ("dtype", "shape", "data_offsets"):
                header[tensor][field] = value
            elif field == "entry":
                header[tensor] = value
            elif field == "structure":
                header.setdefault("__metadata__", {})["structure"] = json.dumps(value)
            else:
                header["__metadata__"] = value
            text = json.dumps(header).encode()
            data = len(text).to_bytes(8, "little") + text + body
        (folder / name).write_bytes(data)
        resign(folder, name)

    return f"{name} header {field} <- {value!r:.40}", corrupt


def _paths(value, prefix=()):
    """Every path into a JSON document (long lists: their first and last two items)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index in sorted({0, 1, len(value) - 2, len(value) - 1} & set(range(len(value)))):
            yield from _paths(value[index], prefix + (index,))


def json_field_edits(name: str, document: dict):
    """Replace (or delete) any field of a JSON file with any JSON value; re-signed when it is state.json."""
    absurd = st.sampled_from([0, -1, 100000, 2**63, 1e308, float("nan"), "1", [], {}, None, True])

    @st.composite
    def edits(draw):
        path = draw(st.sampled_from(list(_paths(document))))
        delete = bool(path) and draw(st.booleans())
        value = draw(st.one_of(json_values, absurd))

        def corrupt(folder: Path) -> None:
            data = json.loads((folder / name).read_text())
            if not path:
                data = value
            else:
                parent = data
                for key in path[:-1]:
                    parent = parent[key]
                if delete:
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = value
            (folder / name).write_text(json.dumps(data))
            if name != fmt.MANIFEST:
                resign(folder, name)

        return f"{name} {'/'.join(map(str, path)) or '<root>'} {'deleted' if delete else f'<- {value!r:.40}'}", corrupt

    return edits()


@st.composite
def tensor_edits(draw):
    """A model or optimizer tensor of another shape (re-signed): loads, but must not apply."""
    which = draw(st.sampled_from(["model", "optim"]))
    grow = draw(st.integers(1, 3))

    def corrupt(folder: Path) -> None:
        from safetensors.torch import load

        tensors = load((folder / fmt.TENSORS).read_bytes())
        name = sorted(n for n in tensors if n.startswith(which + "/") and tensors[n].dim() > 0)[0]
        tensors[name] = torch.zeros(tensors[name].numel() + grow)
        fmt.write_tensors_atomic(folder / fmt.TENSORS, tensors)
        resign(folder, fmt.TENSORS)

    return f"{which} tensor of another shape (+{grow})", corrupt


@st.composite
def file_edits(draw):
    """Symlinks, extra files, special files and deep nesting."""
    kind = draw(st.sampled_from(["symlink-file", "symlink-extra", "extra", "pickle", "subfolder", "fifo", "deep-state",
                                 "deep-manifest", "deep-structure", "missing"]))
    name = draw(st.sampled_from(FILES))
    extra = draw(st.text(st.characters(codec="ascii", exclude_characters="/\x00"), min_size=1, max_size=12)
                 .filter(lambda n: n not in (".", "..") and n not in FILES and not n.startswith(".")))

    def corrupt(folder: Path) -> None:
        deep = "[" * 100_000 + "]" * 100_000
        if kind == "symlink-file":  # the same bytes, reached through a link
            target = folder.parent / f"outside-{name}"
            shutil.copy(folder / name, target)
            (folder / name).unlink()
            (folder / name).symlink_to(target)
        elif kind == "symlink-extra":
            (folder / extra).symlink_to("/etc/passwd")
        elif kind == "extra":
            (folder / extra).write_bytes(b"{}")
        elif kind == "pickle":
            (folder / extra).write_bytes(pickle.dumps({"x": 1}))
        elif kind == "subfolder":
            (folder / extra).mkdir()
        elif kind == "fifo":  # opening it would block forever
            (folder / name).unlink()
            os.mkfifo(folder / name)
        elif kind == "deep-state":
            (folder / fmt.STATE).write_text(deep)
            resign(folder, fmt.STATE)
        elif kind == "deep-manifest":
            (folder / fmt.MANIFEST).write_text(deep)
        elif kind == "deep-structure":
            fmt.write_atomic(folder / fmt.BATCHES, fmt.encode_tensors({}, {"structure": deep}))
            resign(folder, fmt.BATCHES)
        else:
            (folder / name).unlink()

    return f"{kind} {name if kind in ('symlink-file', 'fifo', 'missing') else repr(extra)}", corrupt


# ---- the promise -------------------------------------------------------------------------------------------------
@contextmanager
def corrupted_copy(root: Path, corrupt):
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / fmt.folder_name(NEWEST)
        shutil.copytree(root / fmt.folder_name(NEWEST), folder)
        corrupt(folder)
        yield folder


@contextmanager
def in_place_of_newest(root: Path, folder: Path):
    """The corrupt folder where the run's newest snapshot is (the original set aside meanwhile)."""
    newest, aside = root / fmt.folder_name(NEWEST), root.parent / "aside"
    os.replace(newest, aside)
    shutil.move(folder, newest, copy_function=shutil.copy)  # FIFOs and links move as they are
    try:
        yield
    finally:
        shutil.rmtree(newest)
        os.replace(aside, newest)


def loads_and_applies(folder: Path, cfg) -> bool:
    """Loading raises SnapshotError or nothing; so does applying what loaded to a freshly built state."""
    from replaybisect.core import loop
    from replaybisect.core.state import apply

    try:
        snapshot = fmt.load(folder)
        apply(loop.build_state(cfg), snapshot.tensors, snapshot.state)
    except SnapshotError as error:
        assert fmt.folder_name(NEWEST) in str(error) or "snapshot" in str(error), error
        return False
    return True


def check_promise(run, area: str, corruption) -> None:
    from replaybisect.replay.restore import logged_losses, replay, restore

    store, run_id, cfg, root = run
    description, corrupt = corruption
    TRIED[area] += 1
    with corrupted_copy(root, corrupt) as folder:
        usable = loads_and_applies(folder, cfg)
        with in_place_of_newest(root, folder):
            restored = restore(store, run_id, cfg=cfg)
    if usable:
        assert restored.step == NEWEST, description
    else:
        assert restored.step == PREVIOUS, description
        assert any(fmt.folder_name(NEWEST) in w for w in restored.warnings), (description, restored.warnings)
        replayed = replay(restored, NEWEST, logged=logged_losses(store, run_id))
        assert replayed.reproduced == "exact", description
    MET[area] += 1


@SETTINGS
@given(corruption=byte_edits())
def test_byte_flips_truncations_and_extensions(run, corruption):
    check_promise(run, "bytes", corruption)


@SETTINGS
@given(corruption=header_edits())
def test_safetensors_header_lengths_and_fields(run, corruption):
    check_promise(run, "safetensors headers", corruption)


@SETTINGS
@given(data=st.data())
def test_manifest_fields(run, data):
    manifest = json.loads((run[3] / fmt.folder_name(NEWEST) / fmt.MANIFEST).read_text())
    check_promise(run, "manifest fields", data.draw(json_field_edits(fmt.MANIFEST, manifest)))


@settings(SETTINGS, max_examples=80)
@given(data=st.data())
def test_state_json_fields(run, data):
    state = json.loads((run[3] / fmt.folder_name(NEWEST) / fmt.STATE).read_text())
    check_promise(run, "state.json fields", data.draw(json_field_edits(fmt.STATE, state)))


@settings(SETTINGS, max_examples=10)
@given(corruption=tensor_edits())
def test_tensors_that_do_not_fit_the_model_or_optimizer(run, corruption):
    check_promise(run, "tensor shapes", corruption)


def _numbered_own_tensor(folder: Path) -> None:
    from safetensors.torch import load

    tensors = load((folder / fmt.TENSORS).read_bytes())
    tensors["optim/own/12"] = torch.zeros(3)  # an optimizer's own entry named as parameter 12 is
    fmt.write_tensors_atomic(folder / fmt.TENSORS, tensors)
    resign(folder, fmt.TENSORS)


def _numbered_own_value(folder: Path) -> None:
    state = json.loads((folder / fmt.STATE).read_text())
    state["optimizer"]["own"] = {"12": 1}
    (folder / fmt.STATE).write_text(json.dumps(state))
    resign(folder, fmt.STATE)


@pytest.mark.parametrize("corruption", [("own tensor named as a parameter", _numbered_own_tensor),
                                        ("own value named as a parameter", _numbered_own_value)], ids=["tensor", "value"])
def test_an_optimizers_own_entry_under_a_parameters_number_is_refused(run, corruption):
    """What a snapshot keeps of an optimizer's own state (optimizer.state["global_step"]) is named as no parameter is:
    one named "12" could stand in for parameter 12's moments, so the snapshot is refused and the one before used."""
    description, corrupt = corruption
    with corrupted_copy(run[3], corrupt) as folder:
        assert not loads_and_applies(folder, run[2]), description
    check_promise(run, "optimizer own entries", corruption)  # (the one before it is restored, exact)


@SETTINGS
@given(corruption=file_edits())
def test_symlinks_extra_files_fifos_and_deep_nesting(run, corruption):
    check_promise(run, "files, links, nesting", corruption)


def test_absurd_thread_count_is_refused_before_torch_sees_it(run):
    """num_threads: 100000 made torch.set_num_threads crash the process."""
    def corrupt(folder: Path) -> None:
        state = json.loads((folder / fmt.STATE).read_text())
        state["num_threads"] = 100000
        (folder / fmt.STATE).write_text(json.dumps(state))
        resign(folder, fmt.STATE)

    check_promise(run, "thread count", ("num_threads 100000", corrupt))
    with corrupted_copy(run[3], corrupt) as folder, pytest.raises(SnapshotError, match="state.json.*num_threads"):
        fmt.load(folder)


def test_a_symlinked_snapshot_folder_is_refused(run, tmp_path):
    good = tmp_path / "elsewhere"
    shutil.copytree(run[3] / fmt.folder_name(NEWEST), good)
    link = tmp_path / fmt.folder_name(NEWEST)
    link.symlink_to(good)
    with pytest.raises(SnapshotError, match="symlink"):
        fmt.load(link)


def test_new_snapshots_are_hashed_with_blake3_and_those_of_earlier_versions_with_sha256_still_load(run, tmp_path):
    """A snapshot written now is of format /2: a BLAKE3 hash for each file. The same folder as an earlier version wrote
    it (format /1, sha256) loads to the same tensors, state and batches. Each format takes its own hash only: a /2
    manifest with a sha256 entry, a /1 with a BLAKE3 one, an entry with both (or one of them null) or neither is refused,
    and so is a file whose bytes no longer match its hash, under either."""
    import hashlib

    import blake3

    _, _, _, root = run
    written = tmp_path / "now" / fmt.folder_name(NEWEST)
    shutil.copytree(root / fmt.folder_name(NEWEST), written)
    manifest = json.loads((written / fmt.MANIFEST).read_text())
    assert manifest["format"] == fmt.FORMAT == "replaybisect-snapshot/2"
    assert manifest["files"] and all(set(entry) == {"size", "blake3"} for entry in manifest["files"].values())
    for name, entry in manifest["files"].items():
        assert blake3.blake3((written / name).read_bytes()).hexdigest() == entry["blake3"]
    now = fmt.load(written)

    def sha256(payload: bytes) -> dict:
        return {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}

    def with_manifest(case: str, format_: str, entry_of, flip: bool = False) -> Path:
        changed = tmp_path / case / fmt.folder_name(NEWEST)
        shutil.copytree(written, changed)
        files = {name: entry_of((changed / name).read_bytes()) for name in manifest["files"]}
        (changed / fmt.MANIFEST).write_text(json.dumps({**manifest, "format": format_, "files": files}))
        if flip:  # a byte of the tensors changed after its hash was taken
            tensors = bytearray((changed / fmt.TENSORS).read_bytes())
            tensors[-1] ^= 1
            (changed / fmt.TENSORS).write_bytes(bytes(tensors))
        return changed

    older = fmt.load(with_manifest("older", fmt.FORMAT_SHA256, sha256))
    assert now.tensors.keys() == older.tensors.keys() and all(torch.equal(now.tensors[k], older.tensors[k]) for k in now.tensors)
    assert now.state == older.state and now.batches.keys() == older.batches.keys()
    refused = {
        "sha256 under /2": with_manifest("sha256-in-2", fmt.FORMAT, sha256),
        "BLAKE3 under /1": with_manifest("blake3-in-1", fmt.FORMAT_SHA256, fmt.file_entry),
        "both": with_manifest("both", fmt.FORMAT, lambda payload: {**fmt.file_entry(payload), **sha256(payload)}),
        "a null beside": with_manifest("null", fmt.FORMAT, lambda payload: {**fmt.file_entry(payload), "sha256": None}),
        "neither": with_manifest("neither", fmt.FORMAT, lambda payload: {"size": len(payload)}),
    }
    for case, folder in refused.items():
        with pytest.raises(SnapshotError, match="MANIFEST.json is not a replaybisect-snapshot/2"):
            fmt.load(folder)
    for format_, entry_of in ((fmt.FORMAT, fmt.file_entry), (fmt.FORMAT_SHA256, sha256)):
        with pytest.raises(SnapshotError, match="checksum mismatch"):
            fmt.load(with_manifest(f"flipped-{entry_of.__name__}", format_, entry_of, flip=True))
