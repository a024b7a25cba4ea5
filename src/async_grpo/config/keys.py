"""Flat keys and sections: where each field lives, the flat-key mapper, and "did you mean" suggestions.

Every field has one flat name (TRL's, where TRL has the knob) that is unique across sections, so a
key can be written three ways: flat (`learning_rate`), dotted (`optim.learning_rate`) or nested
(`optim: {learning_rate: ...}`). `flatten_mapping` turns any mix of them into flat names and
`nest_mapping` turns flat names into GRPOConfig's nested input; the two together are the
`mode="before"` mapper of `GRPOConfig`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from async_grpo.config.sections import FORMER_SECTIONS, SECTIONS, RunFields

# TRL's spelling -> ours, for fields whose meaning is the same (trl_names.py has every other TRL name)
ALIASES = {
    "vllm_importance_sampling_clip_max": "vllm_importance_sampling_cap",  # TRL's newer name
    "vllm_server_base_url": "vllm_url",
    "vllm_max_model_length": "vllm_max_model_len",
    "vllm_server_timeout": "vllm_startup_timeout_s",
    "dataset_name": "dataset",  # TRL ScriptArguments
    "weight_sync_steps": "vllm_sync_interval",  # TRL AsyncGRPOConfig
    "request_timeout": "vllm_request_timeout_s",  # TRL AsyncGRPOConfig
    "weight_sync_timeout": "weight_sync_timeout_s",  # TRL AsyncGRPOConfig
}


class ConfigError(ValueError):
    """A config value is invalid. The message names the field and the fix."""


class FieldRef(NamedTuple):
    """One config field: its flat (TRL) name, its section (None: top level) and its pydantic field."""

    name: str
    section: str | None
    info: FieldInfo

    @property
    def path(self) -> str:
        """`section.name`, or `name` for a top-level field: where the field sits in GRPOConfig and its YAML."""
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def default(self) -> Any:
        """The field's default value (a fresh one for list fields)."""
        return self.info.get_default(call_default_factory=True)


def _all_fields() -> dict[str, FieldRef]:
    fields = {name: FieldRef(name, None, info) for name, info in RunFields.model_fields.items()}
    for section, model in SECTIONS.items():
        for name, info in model.model_fields.items():
            if name in fields or (name in SECTIONS and name != section):  # the flat mapper needs one place per
                # name; a field named like its own section (`tools`) is told apart by its value (a list, not a mapping)
                raise RuntimeError(f"config field {name!r} in section {section!r} is not unique")
            fields[name] = FieldRef(name, section, info)
    return fields


FIELDS: dict[str, FieldRef] = _all_fields()  # flat name -> field, top level first, then section by section


def lookup_field(key: Any) -> FieldRef | None:
    """The field `key` names: a flat name, a TRL alias, or `section.name` (its section, or the one it moved from:
    `FORMER_SECTIONS`, so `optim.max_steps` still names `batch.max_steps`); None if it names no field (including a
    real name under the wrong section, such as `loss.learning_rate`)."""
    if not isinstance(key, str):
        return None
    section, dot, name = key.strip().rpartition(".")
    ref = FIELDS.get(ALIASES.get(name, name))
    if ref is None or (dot and section not in (ref.section, FORMER_SECTIONS.get(ref.name))):
        return None
    return ref


def flatten_mapping(data: Mapping[Any, Any]) -> dict[Any, Any]:
    """A config mapping written flat, nested by section, dotted, or any mix -> {flat name: value}.

    Keys that name no field are kept as written (those inside a section mapping as `section.key`), so
    validation reports them, with a suggestion. A section given as a model instance contributes the
    fields that were set on it; an empty section (`optim:` in YAML, None) contributes nothing.

    Raises:
        ConfigError: one field is given under two spellings (flat, alias, dotted, nested) with
            different values; the message names both.
    """
    flat: dict[Any, Any] = {}
    written: dict[Any, str] = {}
    for key, value in data.items():
        if key in SECTIONS and (value is None or isinstance(value, (Mapping, BaseModel))):
            items = value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value or {}
            pairs = [(f"{key}.{sub}", sub_value) for sub, sub_value in items.items()]
        else:
            pairs = [(key, value)]
        for spelled, item in pairs:
            ref = lookup_field(spelled)
            target = ref.name if ref is not None else spelled
            if target in flat and flat[target] != item:
                raise ConfigError(
                    f"{written[target]} and {spelled} are both given, with different values ({flat[target]!r} and "
                    f"{item!r}); they name the same field{f' ({ref.path})' if ref else ''}. Fix: keep one of them."
                )
            flat[target] = item
            written.setdefault(target, str(spelled))
    return flat


def nest_mapping(flat: Mapping[Any, Any]) -> dict[Any, Any]:
    """{flat name: value} (other keys as written) -> GRPOConfig's input, with each field in its section.

    A key that names no field stays where it points (`optim.learning_rat` inside `optim`, anything
    else at the top level), so the validation error's location is the key as the user wrote it.
    """
    nested: dict[Any, Any] = {}
    for key, value in flat.items():
        ref = FIELDS.get(key) if isinstance(key, str) else None
        section, name = (ref.section, ref.name) if ref is not None else (None, key)
        if ref is None and isinstance(key, str) and key.partition(".")[0] in SECTIONS and "." in key:
            section, _, name = key.partition(".")
        if section is None:  # a top-level field, an unknown key, or a section given as a non-mapping
            nested[key] = value
            continue
        target = nested.setdefault(section, {})
        if isinstance(target, dict):  # else the section was given as a non-mapping: that is the error to report
            target[name] = value
    return nested


def suggest(key: str) -> str | None:
    """The closest valid spelling of an unknown key: the right section for a known name in the wrong one,
    else the nearest flat name, alias, `section.name` or section name (difflib), else None."""
    name = key.rpartition(".")[2]
    ref = FIELDS.get(ALIASES.get(name, name))
    if ref is not None and ref.path != key:
        return ref.path
    from async_grpo.config.trl_names import IGNORED, PENDING, REFUSED

    candidates = [
        *FIELDS,
        *ALIASES,
        *SECTIONS,
        *(ref.path for ref in FIELDS.values() if ref.section),
        *REFUSED,
        *IGNORED,
        *PENDING,
    ]
    matches = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(key: str) -> str:
    """`; did you mean `x`?` for an unknown key, or "" when nothing is close."""
    match = suggest(key)
    return f"; did you mean `{match}`?" if match else ""
