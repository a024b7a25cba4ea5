"""`transports.weights.checkpoint`: a checkpoint's tensors read from its safetensors files, in the model's layer
order, and the layout check that decides whether a second checkpoint may be pushed into a server of the first."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from async_grpo.tiny_model import build_tiny_model
from async_grpo.transports.weights.checkpoint import CheckpointSource, layout_difference


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return build_tiny_model(root / "a", seed=0), build_tiny_model(root / "b", seed=1)


def test_the_source_yields_every_tensor_of_the_files_in_layer_order(two_seeds):
    folder, _ = two_seeds
    source = CheckpointSource(folder)
    on_disk = load_file(str(folder / "model.safetensors"))
    names = [m.name for m in source.metadata()]
    assert sorted(names) == sorted(on_disk) and len(names) == len(on_disk)
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers)  # layer 0's tensors, then layer 1's (not the files' alphabetical order)
    assert [(m.dtype, tuple(m.shape)) for m in source.metadata()] == [
        (on_disk[n].dtype, tuple(on_disk[n].shape)) for n in names
    ]
    seen = list(source)
    assert [name for name, _ in seen] == names
    assert all(torch.equal(tensor, on_disk[name]) for name, tensor in seen)


def test_shards_are_read_across_files(tmp_path, two_seeds):
    folder, _ = two_seeds
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[: len(names) // 2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[len(names) // 2 :]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert {name: t for name, t in CheckpointSource(tmp_path)}.keys() == tensors.keys()


def test_same_layout_other_values_can_share_a_server(two_seeds):
    a, b = two_seeds
    assert layout_difference(a, b) is None
    assert not torch.equal(next(iter(CheckpointSource(a)))[1], next(iter(CheckpointSource(b)))[1])


def test_a_different_width_is_named(tmp_path, two_seeds):
    wide = build_tiny_model(tmp_path / "wide", seed=0, hidden_size=256, num_heads=8)
    reason = layout_difference(two_seeds[0], wide)
    assert reason.startswith("tensor ") and "(320, 128) served, (320, 256) in " in reason


def test_a_config_or_sampling_default_that_differs_is_named(tmp_path, two_seeds):
    import shutil

    other = shutil.copytree(two_seeds[1], tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config.get("rms_norm_eps") != 1e-5 else 1e-6
    config["transformers_version"] = "0.0.1"  # ignored: says nothing about the computation
    (other / "config.json").write_text(json.dumps(config))
    assert layout_difference(two_seeds[0], other).startswith("config.json rms_norm_eps: ")

    again = shutil.copytree(two_seeds[1], tmp_path / "again")
    generation = json.loads((again / "generation_config.json").read_text())
    generation["temperature"] = 0.3
    (again / "generation_config.json").write_text(json.dumps(generation))
    assert layout_difference(two_seeds[0], again).startswith("generation_config.json temperature: ")


def test_a_pickle_only_checkpoint_is_never_read(tmp_path, two_seeds):
    (tmp_path / "config.json").write_text((two_seeds[0] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        CheckpointSource(tmp_path)
    assert layout_difference(two_seeds[0], tmp_path).startswith("cannot read both checkpoints")
