"""The safetensors reader: views equal the safetensors library's tensors, in every case."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.models.checkpoint_files import ShardFile, copy_into, iter_tensors, read_header


def test_views_equal_the_librarys_tensors_and_survive_release(tmp_path) -> None:
    tensors = {
        "a": torch.randn(300, 70).to(torch.bfloat16),
        "b": torch.randn(5000),
        "c": torch.arange(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    expected = load_file(str(tmp_path / "model.safetensors"))
    seen = {}
    for name, key, view in iter_tensors(tmp_path, lambda k: k.upper(), release=True):
        assert name == key.upper()
        seen[key] = view  # kept past its release: its pages come back from the file
    assert seen.keys() == expected.keys()
    for key, view in seen.items():
        assert view.dtype == expected[key].dtype and torch.equal(view, expected[key]), key


def test_misaligned_tensor_is_copied_out(tmp_path) -> None:
    """A file whose bf16 tensor starts at an odd offset (the format allows it)."""
    odd = bytes([1, 2, 3])
    value = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    header = {
        "odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "w": {"dtype": "BF16", "shape": [3], "data_offsets": [3, 9]},
    }
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    file = tmp_path / "model.safetensors"
    file.write_bytes(
        struct.pack("<Q", len(body)) + body + odd + value.view(torch.uint8).numpy().tobytes()
    )
    shard = ShardFile(file)
    assert torch.equal(shard.tensor("w"), value)
    assert shard.tensor("odd").tolist() == [1, 2, 3]


def test_malformed_headers_are_named(tmp_path) -> None:
    file = tmp_path / "bad.safetensors"
    file.write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="shorter than 8 bytes"):
        read_header(file)
    body = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    file.write_bytes(struct.pack("<Q", len(body)) + body + bytes(8))
    with pytest.raises(ValueError, match="'w' has inconsistent offsets 0..8"):
        read_header(file)
    body = json.dumps({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    file.write_bytes(struct.pack("<Q", len(body)) + body + bytes(8))
    with pytest.raises(ValueError, match="unsupported dtype 'C64'"):
        read_header(file)


def test_no_index_and_a_key_in_two_files(tmp_path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="'w' is in both a.safetensors and b.safetensors"):
        list(iter_tensors(tmp_path, lambda k: k))


def test_copy_into_converts_and_checks(tmp_path) -> None:
    weights = {"a.w": torch.randn(4, 3).to(torch.bfloat16), "b.w": torch.randn(2)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    targets = {"a": torch.empty(4, 3), "b": torch.empty(2, dtype=torch.bfloat16)}
    stats = copy_into(targets, tmp_path, lambda k: k.removesuffix(".w"))
    assert stats.num_tensors == 2 and stats.nbytes == 4 * 3 * 2 + 2 * 4
    assert torch.equal(targets["a"], weights["a.w"].float())
    assert torch.equal(targets["b"], weights["b.w"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="b.w has no place in the model"):
        copy_into({"a": torch.empty(4, 3)}, tmp_path, lambda k: k.removesuffix(".w"))
    assert copy_into({"a": torch.empty(4, 3)}, tmp_path, lambda k: k[0], ignore_unknown=True)
    with pytest.raises(ValueError, match=r"lacks \['c'\] \(1 missing\)"):
        copy_into({**targets, "c": torch.empty(1)}, tmp_path, lambda k: k.removesuffix(".w"))
    with pytest.raises(ValueError, match=r"a.w has shape \(4, 3\), the config implies \(3, 4\)"):
        copy_into({"a": torch.empty(3, 4)}, tmp_path, lambda k: k[0], ignore_unknown=True)
