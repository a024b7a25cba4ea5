"""Serve a saved checkpoint's weights from a running vLLM server, without starting another one.

The pipeline's `evaluate` step scores the trained checkpoint and then the registry's champion on the same held-out
prompts. Starting a second `vllm serve` for the champion costs a whole server start (25-60 s on 2 CPU cores for the
tiny model, minutes for a large model on a GPU node) for weights that differ only in their values. When both
checkpoints have the same parameter names and shapes, the champion's tensors are read straight from its
`*.safetensors` files and sent through the same weight-transfer plane the trainer uses (`WeightPusher`): the server
then serves exactly the file's values, cast once to the server's dtype as vLLM's own load would cast them
(`transports.weights.cast`). Nothing is unpickled and no model object is built.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer import WeightSource
from vllm.distributed.weight_transfer.base import ParamMeta

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors header dtype names -> torch dtypes (the header's `dtype` field)."""

# config.json fields that say nothing about how the weights compute: the saved dtype (the push casts to the server's),
# the folder and library version that wrote it, the cache switch. Any other difference (architecture, sizes, rope,
# norm epsilon, activation, tied head) keeps the checkpoints on separate servers.
IGNORED_CONFIG_FIELDS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"})
# the files compared field by field: the architecture, and the sampling defaults vLLM reads from the served folder
COMPARED_FILES = ("config.json", "generation_config.json")


def _natural(name: str) -> list:
    """Sort key that orders `layers.10` after `layers.9` (the model's own layer order)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def safetensors_files(folder: Path | str) -> list[Path]:
    """The `*.safetensors` files of an HF checkpoint folder, sorted by name (a sharded checkpoint's shards).

    Raises:
        FileNotFoundError: the folder holds no `*.safetensors` file (a pickle-only `.bin` checkpoint is not read).
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors file (a .bin checkpoint cannot be pushed)")
    return files


class CheckpointSource(WeightSource):
    """vLLM `WeightSource` over the tensors of an HF checkpoint folder's `*.safetensors` files.

    Names are the file's keys (the HF parameter names vLLM's `load_weights` expects, as `Learner.named_parameters_
    for_push()` gives them; a tied head is absent from both). Metadata is read from the headers; iteration loads one
    tensor at a time (memory: one tensor beyond what the caller keeps).

    Args:
        folder: the checkpoint folder.

    Raises:
        FileNotFoundError: no `*.safetensors` file in `folder`.
    """

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self._where: dict[str, Path] = {}
        self._meta: list[ParamMeta] = []
        for path in safetensors_files(self.folder):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (a safe_open handle is not a mapping)
                    piece = f.get_slice(name)
                    self._where[name] = path
                    self._meta.append(ParamMeta(name, _DTYPES[piece.get_dtype()], tuple(piece.get_shape())))
        self._meta.sort(key=lambda m: _natural(m.name))

    def metadata(self) -> list[ParamMeta]:
        """Every tensor's (name, dtype, shape), in the model's layer order."""
        return list(self._meta)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> shape of every tensor in the checkpoint."""
        return {m.name: tuple(m.shape) for m in self._meta}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with contextlib.ExitStack() as stack:  # each file opened once per pass, whatever order its tensors come in
            handles: dict[Path, Any] = {}
            for meta in self._meta:
                path = self._where[meta.name]
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                yield meta.name, handles[path].get_tensor(meta.name)


def layout_difference(served: Path | str, other: Path | str) -> str | None:
    """Why `other`'s weights cannot be pushed into a server that serves `served`, or None when they can.

    They can when both folders hold safetensors with the same tensor names and shapes and their `COMPARED_FILES`
    (config.json, and generation_config.json, whose sampling defaults vLLM takes from the served folder) agree on
    every field but `IGNORED_CONFIG_FIELDS`.

    Returns:
        None, or a one-line reason naming the first difference (a missing file, a tensor, a config field).
    """
    try:
        mine, theirs = CheckpointSource(served).shapes(), CheckpointSource(other).shapes()
        configs = {name: (_json(Path(served) / name), _json(Path(other) / name)) for name in COMPARED_FILES}
    except (OSError, ValueError) as err:
        return f"cannot read both checkpoints: {err}"
    for name in sorted(mine.keys() | theirs.keys(), key=_natural):
        if mine.get(name) != theirs.get(name):
            return f"tensor {name}: {mine.get(name)} served, {theirs.get(name)} in {other}"
    for file, (a, b) in configs.items():
        for field in sorted((a.keys() | b.keys()) - IGNORED_CONFIG_FIELDS):
            if a.get(field) != b.get(field):
                return f"{file} {field}: {a.get(field)!r} served, {b.get(field)!r} in {other}"
    return None


def _json(path: Path) -> dict:
    """A JSON object file's content; {} when the file is absent (an optional generation_config.json).

    Raises:
        ValueError: the file is not a JSON object. OSError: it cannot be read."""
    if not path.exists() and path.name != "config.json":
        return {}
    value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


def push_checkpoint(folder: Path | str, url: str, *, vllm_dtype: str, backend: str, timeout_s: float) -> float:
    """Send every tensor of the checkpoint `folder` to the vLLM server at `url` (weight transfer on, as the trainer's
    servers are started) and resume it: the server then samples with the checkpoint's weights. Check
    `layout_difference` first: a checkpoint of another layout fails inside vLLM's load.

    Args:
        folder: HF checkpoint folder with `*.safetensors` files.
        url: the server's base URL.
        vllm_dtype: the server's `--dtype`; a 16-bit one gets the tensors cast on the way (`cast.for_server`).
        backend: the weight-transfer data plane the server was started with ("gloo", "nccl" or "auto").
        timeout_s: rendezvous, control-plane and broadcast timeout (seconds).

    Returns:
        The push's seconds (pause to resume).

    Raises:
        FileNotFoundError: no `*.safetensors` in `folder`.
        requests.HTTPError / RuntimeError: the server refused the handshake or the update, or timed out.
    """
    from async_grpo.transports.weights.cast import for_server
    from async_grpo.transports.weights.sync import WeightPusher, rendezvous_address

    source = for_server(CheckpointSource(folder), vllm_dtype)
    pusher = WeightPusher(source, url, backend=backend, timeout_s=timeout_s, master_address=rendezvous_address(url))
    try:
        return pusher.push(version=1)
    finally:
        pusher.close()
