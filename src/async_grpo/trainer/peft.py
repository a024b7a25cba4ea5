"""LoRA on the policy (TRL `use_peft`): wrap it with peft, train only the adapter, and hand vLLM either merged
weights under the base model's names or the adapter files.

LoRA (Hu et al. 2021, arXiv 2106.09685, eq. 3) replaces a linear layer's h = W x by h = W x + (alpha / r) B A x
with W frozen, A (r, in) random and B (out, r) zero at the start, so the wrapped policy starts equal to the base
model. `PeftLearner` is a `GRPOLearner` over the peft model: AdamW sees the adapter parameters only, the KL
reference is the base model with the adapters disabled (no copy of the weights), and the learner state (model
and AdamW state) round-trips through `state_dict` as before. `MergedLoRASource` streams W + (alpha / r) B A per
layer under the base names vLLM's `load_weights` expects, without touching the training weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer import ParamMeta, WeightSource

from async_grpo.trainer.protocol import AdapterPush
from async_grpo.trainer.trainer import GRPOLearner

logger = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name; the only adapter the policy carries
ADAPTER_FOLDER = "adapter"  # `save_pretrained(path)` writes the adapter to path/adapter/


def wrap_with_lora(
    model: torch.nn.Module,
    *,
    r: int,
    alpha: int,
    dropout: float,
    target_modules: list[str] | str | None,
    disable_dropout: bool = False,
) -> Any:
    """`peft.get_peft_model(model, LoraConfig(...))` with TRL ModelConfig's meaning of the fields.

    Args:
        model: a transformers causal LM (float32).
        r, alpha, dropout, target_modules: `lora_r`, `lora_alpha`, `lora_dropout`, `lora_target_modules`.
        disable_dropout: zero the LoRA dropout too (TRL's `disable_dropout` runs after wrapping).

    Returns:
        the `peft.PeftModel`; only its `lora_A` / `lora_B` parameters require grad.

    Raises:
        ValueError: target_modules match no module of the model (the message lists the linear layers it has, and
            names the field `lora_target_modules`).
    """
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0 if disable_dropout else dropout,
        target_modules=target_modules,
        task_type=TaskType.CAUSAL_LM,
        bias="none",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(
            f"peft.lora_target_modules={target_modules!r}: {err}. The model's linear layers are "
            f"{names}. Fix: pick some of those, or all-linear, or remove it for peft's default."
        ) from err


class _AdaptersOff(torch.nn.Module):
    """The base model as a module: calls the peft model with its adapters disabled (the KL reference).

    It registers no parameters of its own (the peft model is held outside the module tree), so it adds no memory.
    `get_decoder()` / `get_output_embeddings()` serve the chunked log-prob path (`trainer.logprobs`)."""

    def __init__(self, peft_model: Any, body: Any = None):
        super().__init__()
        self.__dict__["_peft"] = peft_model
        self.__dict__["_body"] = body

    def forward(self, *args, **kwargs):
        with self._peft.disable_adapter(), torch.no_grad():
            return (self._body or self._peft)(*args, **kwargs)

    def get_decoder(self) -> _AdaptersOff:
        return _AdaptersOff(self._peft, self._peft.get_decoder())

    def get_output_embeddings(self) -> Any:
        return self._peft.get_output_embeddings()


class PeftLearner(GRPOLearner):
    """A `GRPOLearner` over a LoRA-wrapped policy (see the module docstring).

    Args:
        model: the peft model from `wrap_with_lora` (adapter parameters trainable, the rest frozen).
        **kwargs: `GRPOLearner`'s (fsdp must be False).

    Raises:
        ValueError: fsdp=True (not supported with LoRA), or `GRPOLearner`'s errors.
    """

    def __init__(self, model: Any, **kwargs):
        if kwargs.get("fsdp"):
            raise ValueError("use_peft with fsdp is not supported. Fix: set fsdp: false.")
        super().__init__(model, **kwargs)

    def reference_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The KL reference: the base model with the adapters disabled (LoRA's B starts at 0, so this is the
        initial policy; no copy of the weights)."""
        return _AdaptersOff(model)

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """{peft name: parameter} of the adapter (what AdamW updates)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def named_parameters_for_push(self) -> MergedLoRASource:
        """The merged policy under the base model's parameter names (`MergedLoRASource`)."""
        return MergedLoRASource(self.model)

    def base_weights_for_push(self) -> MergedLoRASource:
        """The base weights W alone (adapters left out) under their HF names: what vLLM must hold under the adapter
        with vllm_lora_sync (the base may differ from the server's model folder after a warm start or a resume)."""
        return MergedLoRASource(self.model, with_adapter=False)

    def adapter_for_push(self) -> AdapterPush:
        """The base weights (`base_weights_for_push`) and the adapter's writer (`save_adapter`) for vllm_lora_sync."""
        return AdapterPush(base=self.base_weights_for_push(), save_adapter=self.save_adapter)

    def save_adapter(self, path: str | Path) -> int:
        """Write the adapter only (peft `save_pretrained`: adapter_config.json + adapter_model.safetensors) to
        `path`; returns the bytes of the files written."""
        path = Path(path)
        self.model.save_pretrained(str(path), safe_serialization=True)
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())

    def save_pretrained(self, path) -> None:
        """Write the merged policy as a plain Hugging Face folder (what evaluation, vLLM and the registry read), and
        the adapter to `path/adapter/`. The training weights are not changed."""
        from async_grpo.trainer.distributed import save_pretrained

        base = self.model.get_base_model()
        state = {k: v.detach().cpu() for k, v in base.state_dict().items() if ".lora_" not in k}
        merged = {name: tensor.detach().cpu() for name, tensor in MergedLoRASource(self.model)}
        state = {_base_name(k): merged.get(_base_name(k), v) for k, v in state.items()}
        save_pretrained(base, state, path)
        self.save_adapter(Path(path) / ADAPTER_FOLDER)


class MergedLoRASource(WeightSource):
    """vLLM `WeightSource` of the merged policy: for every base parameter, under its base (HF) name, the weight
    W + scaling x B A of a LoRA layer (peft `get_delta_weight`, scaling = lora_alpha / r, as `merge_and_unload`
    computes it), or the parameter itself elsewhere. Fresh tensors: the training weights are never modified.

    Args:
        peft_model: the `peft.PeftModel` (not sharded).
        with_adapter: False streams the base weights W alone.
    """

    def __init__(self, peft_model: Any, with_adapter: bool = True):
        self.peft_model = peft_model
        self.with_adapter = with_adapter

    def _params(self) -> Iterator[tuple[str, torch.nn.Parameter, Any]]:
        base = self.peft_model.get_base_model()
        modules = dict(base.named_modules())
        for name, param in base.named_parameters():
            if ".lora_" in name:
                continue
            layer = None
            if ".base_layer." in name and name.endswith(".weight"):
                layer = modules[name.rsplit(".base_layer.", 1)[0]]
            yield _base_name(name), param, layer

    def metadata(self) -> list[ParamMeta]:
        """(base name, dtype, shape) of every parameter, in iteration order."""
        return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p, _ in self._params()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, param, layer in self._params():
                if layer is None or not self.with_adapter or ADAPTER not in getattr(layer, "lora_A", {}):
                    yield name, param.detach()
                else:
                    yield name, param.detach() + layer.get_delta_weight(ADAPTER).to(param.dtype)

    def nbytes(self) -> int:
        """Bytes one push sends: sum of numel x element size over `metadata()`."""
        return sum(math.prod(m.shape) * m.dtype.itemsize for m in self.metadata())


def _base_name(peft_name: str) -> str:
    """`model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`."""
    return peft_name.replace(".base_layer.", ".")
