"""heads.hf_folder: config.json and named tensors across a folder's *.safetensors files, with errors that name them."""
import pytest
import torch
from safetensors.torch import save_file

from heads.hf_folder import read_config, read_tensors, tensor_shapes


def test_tensors_are_read_across_shards(tmp_path):
    save_file({"a": torch.zeros(2, 3)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(4)}, tmp_path / "model-00002-of-00002.safetensors")
    assert sorted(read_tensors(tmp_path)) == ["a", "b"]
    assert read_tensors(tmp_path, ["b", "absent"])["b"].equal(torch.ones(4))
    assert "absent" not in read_tensors(tmp_path, ["b", "absent"])
    assert tensor_shapes(tmp_path) == {"a": [2, 3], "b": [4]}


def test_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="has no config.json: a target is a folder"):
        read_config(tmp_path, "a target is a folder")
    with pytest.raises(ValueError, match=r"has no \*.safetensors weights"):
        read_tensors(tmp_path)
    (tmp_path / "config.json").write_text('{"a": ')
    with pytest.raises(ValueError, match="config.json is malformed"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="malformed: expected a JSON object, got list"):
        read_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="model.safetensors is unreadable"):
        read_tensors(tmp_path)
