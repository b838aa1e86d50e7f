"""The snapshot's tensors file written from one page-aligned host image (core/snapshot.TensorsImage): the same
tensors read back through the safetensors library and the project's own layout check, with O_DIRECT where the file
system takes it and through the page cache where it does not (tmpfs)."""

from __future__ import annotations

from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load

from replaybisect.core import snapshot as fmt

TENSORS = {
    "model/weight": torch.randn(33, 17),
    "model/half": torch.randn(5, 3).half(),
    "model/bf": torch.randn(7).bfloat16(),
    "model/double": torch.randn(3, 2, dtype=torch.float64),
    "model/count": torch.tensor(3, dtype=torch.int64),
    "model/mask": torch.tensor([True, False, True]),
    "model/bytes": torch.arange(11, dtype=torch.uint8),
    "model/empty": torch.empty(0, 4),
    "optim/0/step": torch.tensor(12.0),
    "optim/0/exp_avg": torch.randn(33, 17),
}


def write_image(path: Path) -> dict:
    entries = list(TENSORS.items())
    image = fmt.TensorsImage(fmt.TensorsImage.layout_of(entries))
    for name, tensor in entries:
        image.views[name].copy_(tensor)
    return image.write_atomic(path)


def assert_same_tensors(path: Path, entry: dict) -> None:
    payload = path.read_bytes()
    assert entry == {"size": len(payload), "blake3": blake3.blake3(payload).hexdigest()}
    fmt.safetensors_layout(payload)  # the layout check snapshots are loaded through
    loaded = load(payload)
    assert set(loaded) == set(TENSORS)
    for name, tensor in TENSORS.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_image_written_to_disk_reads_back(tmp_path):
    entry = write_image(tmp_path / fmt.TENSORS)
    assert_same_tensors(tmp_path / fmt.TENSORS, entry)
    header_length = int.from_bytes((tmp_path / fmt.TENSORS).read_bytes()[:8], "little")
    assert (8 + header_length) % fmt.PAGE == 0  # the data starts on a page: O_DIRECT writes the image as it is
    assert [p.name for p in tmp_path.iterdir()] == [fmt.TENSORS]  # no temp left


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
def test_image_on_a_file_system_without_direct_io(tmp_path):
    """tmpfs refuses O_DIRECT: the same file is written through the page cache."""
    folder = Path("/dev/shm") / tmp_path.name
    folder.mkdir()
    try:
        entry = write_image(folder / fmt.TENSORS)
        assert_same_tensors(folder / fmt.TENSORS, entry)
        assert entry == write_image(tmp_path / fmt.TENSORS)  # byte for byte what the direct write gave
    finally:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def test_views_are_aligned_and_reused_only_for_the_same_layout():
    entries = list(TENSORS.items())
    layout = fmt.TensorsImage.layout_of(entries)
    image = fmt.TensorsImage(layout)
    assert image.buffer.data_ptr() % fmt.PAGE == 0 and image.buffer.numel() % fmt.PAGE == 0
    for name, view in image.views.items():
        assert view.data_ptr() % view.element_size() == 0, name
    grown = [(name, torch.zeros(40, 17) if name == "model/weight" else tensor) for name, tensor in entries]
    assert fmt.TensorsImage.layout_of(grown) != layout
    assert fmt.TensorsImage.layout_of([("model/z", torch.zeros(2, dtype=torch.complex64))]) is None


def test_where_the_file_system_takes_o_direct_the_image_is_written_with_it(tmp_path, monkeypatch):
    """The direct write is what runs where O_DIRECT opens (else the test says why it cannot tell): it is not the
    page-cache fallback that made the other tests pass."""
    import os

    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    direct = []
    real = fmt._write_direct
    monkeypatch.setattr(fmt, "_write_direct", lambda *args: direct.append(real(*args)) or direct[-1])
    assert_same_tensors(tmp_path / fmt.TENSORS, write_image(tmp_path / fmt.TENSORS))
    assert direct == [True]


def test_the_header_builder_lays_tensors_out_in_the_order_given_8_byte_aligned():
    """write_tensors_atomic and the image share the header builder: the 8-byte-aligned header of the tensors in the
    order they are given (the layout the snapshot fuzz and tamper tests rewrite files with)."""
    import json

    tensors = {"b": torch.ones(3), "a": torch.arange(5, dtype=torch.int64)}
    head, spans, size = fmt._safetensors_head([(name, tuple(t.shape), t.dtype) for name, t in sorted(tensors.items())], {"k": "v"})
    header = json.loads(head[8:])
    assert len(head) % 8 == 0 and size == 52 and spans == {"a": (0, 40), "b": (40, 52)}
    assert header["__metadata__"] == {"k": "v"} and header["a"] == {"dtype": "I64", "shape": [5], "data_offsets": [0, 40]}


@pytest.mark.parametrize("joined", [1 << 22, 100], ids=["default", "runs cut at 100 bytes"])
def test_the_streaming_writer_joins_small_tensors_and_the_file_loads_bit_for_bit(tmp_path, monkeypatch, joined):
    """write_tensors_atomic writes runs of small tensors of one dtype as one chunk (JOINED bytes at most), largest
    element first: the safetensors library and the snapshot reader's layout check read every tensor back as it was, and
    the size and BLAKE3 hash it returns are the file's."""

    from safetensors.torch import load_file

    monkeypatch.setattr(fmt, "JOINED", joined)
    generator = torch.Generator().manual_seed(0)
    tensors = {f"{step}/{index}": torch.randint(0, 50, (8, 3), generator=generator) for step in range(20) for index in range(2)}
    tensors |= {f"{step}/rng": torch.randint(0, 255, (17,), dtype=torch.uint8, generator=generator) for step in range(20)}
    tensors |= {"big": torch.randn(40_000, generator=generator), "half": torch.randn(5, generator=generator).half(),
                "flag": torch.tensor([True, False]), "scalar": torch.tensor(2.5, dtype=torch.float64),
                "strided": torch.arange(12.0).reshape(3, 4).t()}
    path = tmp_path / "b.safetensors"
    written = fmt.write_tensors_atomic(path, tensors, {"k": "v"})
    payload = path.read_bytes()
    assert written == {"size": len(payload), "blake3": blake3.blake3(payload).hexdigest()}
    _, metadata = fmt.safetensors_layout(payload)
    loaded = load_file(str(path))
    assert metadata == {"k": "v"} and loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
