"""A model folder's safetensors files checked by their headers alone (no tensor read): what a partial download or a
saved error page leaves is one line before a run starts; a file whose header passes but whose tensors do not load is
still one line when the weights load."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import compose_cfg
from wanexp.errors import ConfigError
from wanexp.models.family import safetensors_problem
from wanexp.module import _readable
from wanexp.composition import build


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(64), "b": torch.ones(3, 5)}, str(path), metadata={"format": "pt"})
    return path


def _header(path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_a_complete_file_passes_and_damaged_ones_say_what_is_wrong(weights):
    assert safetensors_problem(weights) is None
    raw = weights.read_bytes()
    header, data = _header(weights)
    weights.write_bytes(raw[:-100])  # a download cut short in the data
    assert safetensors_problem(weights) == \
        "truncated: it holds 216 of the 316 bytes of tensor data its header describes"
    weights.write_bytes(raw[:20])  # cut short in the header
    assert "too short for the header it announces" in safetensors_problem(weights)
    weights.write_bytes(b"")
    assert "too short for the header it announces" in safetensors_problem(weights)
    weights.write_bytes(b"<!DOCTYPE html><html>rate limited</html>")  # an error page saved under the name
    assert "(truncated, or not a safetensors file)" in safetensors_problem(weights)
    with open(weights, "wb") as f:  # a large file of another format (sparse: nothing is written but the 8 bytes)
        f.write((200_000_000).to_bytes(8, "little"))
        f.truncate(200_000_016)
    assert "above safetensors' limit (not a safetensors file)" in safetensors_problem(weights)
    weights.write_bytes(raw + b"\0" * 10)
    assert safetensors_problem(weights) == "10 bytes more than the 316 of tensor data its header describes (damaged)"
    _write(weights, {**header, "b": {**header["b"], "data_offsets": None}}, data)
    assert safetensors_problem(weights) == "its header gives tensor b no valid data_offsets (damaged)"
    _write(weights, ["not", "a", "header"], data)
    assert "not a safetensors header" in safetensors_problem(weights)
    weights.write_bytes((4).to_bytes(8, "little") + b"\xff\xfe{]" + data)
    assert "not a safetensors header" in safetensors_problem(weights)


def test_the_load_stays_a_backstop_for_what_the_header_does_not_show(weights, tmp_path):
    """Offsets that span the data but disagree with a tensor's shape pass the header check; the load refuses them,
    as one line."""
    header, data = _header(weights)
    header["b"]["shape"] = [3, 6]
    _write(weights, header, data)
    assert safetensors_problem(weights) is None
    spec = build(compose_cfg(["model=tiny", f"model.path={tmp_path}"]).model)
    with pytest.raises(ConfigError) as e:
        _readable(spec, "the dense transformer", load_file, str(weights))
    assert str(e.value).startswith(f"model.path={tmp_path}: cannot read the dense transformer (")
    assert str(e.value).endswith("a weight file there is corrupt or incomplete: download (or convert) it again")
