"""Loading (YAML + `key=value` overrides), dumping (nested YAML, flat params) and error messages."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from async_grpo.config.keys import ALIASES, FIELDS, SECTIONS, ConfigError, FieldRef, did_you_mean, lookup_field
from async_grpo.config.model import GRPOConfig, _flat_items
from async_grpo.config.trl_names import IGNORED, PENDING, REFUSED

TRL_ONLY = {*REFUSED, *IGNORED, *PENDING}  # TRL names that are no field of ours (overrides pass them through)

# Models whose unknown keys get a "did you mean" over GRPOConfig's keys (other models, e.g. the cluster
# settings, share format_validation_error but not these keys).
_CONFIG_TITLES = {GRPOConfig.__name__, *(model.__name__ for model in SECTIONS.values())}


def _override_value(ref: FieldRef, raw: str) -> Any:
    """An override's value: YAML, except for string fields, which keep the raw text (so `run_name=2024`
    stays the string "2024")."""
    if ref.info.annotation in (str, str | None) and raw not in ("", "null", "None", "~"):
        return raw
    return yaml.safe_load(raw) if raw != "" else None


def _field(key: str) -> FieldRef:
    """The field an override key names.

    Raises:
        ConfigError: the key names no field; the message suggests the closest one.
    """
    ref = lookup_field(key)
    if ref is None:
        raise ConfigError(
            f"override {key!r}: unknown config field. Fix: check the spelling (see "
            f"`async-grpo train --help`){did_you_mean(key)}"
        )
    return ref


def _parse_override(item: str) -> list[tuple[FieldRef | str, Any]]:
    """`key=value` -> [(field, value)], the key read as a YAML file reads it. The key is a flat name, a TRL alias or
    `section.name`; a bare section name given a mapping (or nothing: `optim=`, `optim=null`, an empty section, as
    `optim:` in a file) takes its fields (`optim={learning_rate: 1e-5, max_steps: 5}`); a name that is both a section
    and a field or TRL name means that name when its value is no mapping (`tools=[builtin:calculator]` is TRL's
    `tools` list, `optim=adamw_torch` TRL's optimizer name), as in a file; a TRL name that is no field of ours
    (`use_vllm=true`) comes back as the name itself."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value. Fix: write e.g. learning_rate=1e-5.")
    key, raw = item.split("=", 1)
    key = key.strip()
    if key in SECTIONS:
        value = yaml.safe_load(raw) if raw.strip() else None
        if value is None or isinstance(value, Mapping):  # the section (`keys.flatten_mapping`'s rule for a file)
            return [(_field(f"{key}.{sub}"), sub_value) for sub, sub_value in (value or {}).items()]
        if lookup_field(key) is None and not (key in TRL_ONLY and isinstance(value, str)):
            example = next(name for name, ref in FIELDS.items() if ref.section == key)
            raise ConfigError(f"override {key!r}: a section takes a mapping. Fix: write e.g. {key}={{{example}: ...}}.")
    if key in TRL_ONLY:
        return [(key, yaml.safe_load(raw) if raw != "" else None)]  # a TRL-only name (`optim=adamw_torch` too)
    ref = _field(key)
    return [(ref, _override_value(ref, raw))]


def _without(data: dict[str, Any], ref: FieldRef) -> dict[str, Any]:
    """`data` with every spelling of `ref` removed (flat, alias, dotted, inside its section mapping)."""
    names = {ref.name, *(alias for alias, target in ALIASES.items() if target == ref.name)}
    spellings = names | ({f"{ref.section}.{n}" for n in names} if ref.section else set())
    # a field named like its section (`tools`): the section's mapping is kept, less that field
    out = {k: v for k, v in data.items() if k not in spellings or (k == ref.section and isinstance(v, Mapping))}
    if ref.section and isinstance(out.get(ref.section), Mapping):
        out[ref.section] = {k: v for k, v in out[ref.section].items() if k not in names}
    return out


def format_validation_error(err: ValidationError) -> str:
    """Turn a pydantic error into lines naming each bad field (as `section.name`) and how to fix it;
    an unknown GRPOConfig key gets the closest valid spelling."""
    lines = ["invalid config:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(config)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field. Fix: remove it or check the spelling against GRPOConfig"
            if err.title in _CONFIG_TITLES:
                msg += did_you_mean(loc)
        elif "input" in e and e["type"] not in ("value_error",):
            msg = f"{msg} (got {e['input']!r}). Fix: give a value that satisfies this"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _read_yaml(path: Path) -> Any:
    """The YAML document in `path` (None when it holds nothing but comments or whitespace).

    Raises:
        ConfigError: the file cannot be read or is not valid YAML (the message gives the line and column).
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"config file {str(path)!r} cannot be read ({err}). Fix: check its permissions and "
            "that it is a UTF-8 text file."
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML{where}: {problem}. Fix: correct the "
            "syntax there (indentation, a missing ':' or an unclosed quote or bracket)."
        ) from None


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> GRPOConfig:
    """Load a YAML config (flat TRL keys, nested sections, or both) and apply `key=value` overrides
    (`learning_rate=1e-5` or `optim.learning_rate=1e-5`; values parsed as YAML). An override wins over
    the file however either spells the field.

    Raises:
        ConfigError: the file is missing, unreadable, empty, not valid YAML or not a mapping, an override is
            malformed or unknown, or a
            value is invalid; the message names the field and the fix.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(p)!r} does not exist. Fix: pass a YAML file such as examples/tiny_cpu.yaml."
            )
        loaded = _read_yaml(p)
        if loaded is None:
            raise ConfigError(
                f"config file {str(p)!r} is empty. Fix: give at least the fields you change, e.g. "
                "`dataset: builtin:reverse` (examples/tiny_cpu.yaml is a complete one)."
            )
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {str(p)!r} must hold a YAML mapping of field: value (it holds a "
                f"{type(loaded).__name__}). Fix: write one `field: value` per line."
            )
        data.update(loaded)
    return config_from_mapping(data, overrides)


def config_from_mapping(data: Mapping[str, Any], overrides: list[str] | None = None) -> GRPOConfig:
    """`load_config` of a mapping already read (flat TRL keys, nested sections, or both), with the same `key=value`
    overrides: what a pipeline step merges from its parameters, without a temporary file.

    Raises:
        ConfigError: an override is malformed or unknown, or a value is invalid; the message names the field and the
            fix.
    """
    data = dict(data)
    for item in overrides or []:
        for ref, value in _parse_override(item):
            if isinstance(ref, str):  # a TRL-only name
                data.pop(ref, None)
                data[ref] = value
                continue
            data = _without(data, ref)
            # flat (TRL) name: TRL values are converted on the way in (trl_names); a field named like its section
            # (`tools`) goes dotted, beside the section's other fields from the file
            data[ref.path if ref.name in SECTIONS else ref.name] = value
    try:
        return GRPOConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def dump_config(config: GRPOConfig) -> str:
    """The resolved config as nested YAML (every field, defaults included); `load_config` reads it back
    to an equal config."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def flat_dump(config: GRPOConfig, *, mode: str = "python", exclude_defaults: bool = False) -> dict[str, Any]:
    """{flat (TRL) name: value} for every field (or only those off their default), top-level fields
    first, then section by section. `GRPOConfig.model_validate` of it gives back an equal config."""
    return {ref.name: value for ref, value in _flat_items(config, mode, exclude_defaults)}


def flat_params(config: GRPOConfig) -> dict[str, str]:
    """MLflow run params: {flat (TRL) name: value as text} for every field, so a run's params keep the
    flat names (`params["loss_type"] == "dapo"`) whatever section the field is in."""
    return {name: str(value) for name, value in flat_dump(config, mode="json").items()}
