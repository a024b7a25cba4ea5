"""GRPOConfig in sections: flat, nested and mixed input agree; conflicts and typos are named; dumps round-trip;
the flat names (MLflow params, pipeline parameters) and the demo config's values are those of the flat config."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from async_grpo.cli import _field_help
from async_grpo.config import (
    ALIASES,
    FIELDS,
    SECTIONS,
    ConfigError,
    GRPOConfig,
    dump_config,
    flat_dump,
    flat_params,
    flatten_mapping,
    load_config,
    lookup_field,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CPU = REPO_ROOT / "examples" / "tiny_cpu.yaml"
# examples/tiny_cpu.yaml resolved by the flat GRPOConfig before sections (model_dump(mode="json")): its keys
# are the old flat field names, in the old order.
# Values the demo changed since the snapshot, on purpose: the snapshot with them is what tiny_cpu.yaml resolves to now.
CHANGED_BY_THE_DEMO = {
    "skip_zero_advantage_batches": True,  # issue 23: train only nonzero-advantage completions
    "warmup_sft_steps": 400,  # issue 48: a warm start that converges on every seed (1e-3) and stops partway
    "warmup_sft_learning_rate": 1e-3,
    "log_traces_steps": 20,  # issue 53: the demo's episodes as MLflow traces, every 20th step
}
TINY_CPU_FLAT = {
    **json.loads((Path(__file__).parent / "data" / "tiny_cpu_resolved_flat.json").read_text()),
    **CHANGED_BY_THE_DEMO,
}


def write_yaml(tmp_path: Path, data, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def nested(flat: dict) -> dict:
    """A flat mapping written the nested way, by hand from FIELDS (not through the mapper under test)."""
    out: dict = {}
    for key, value in flat.items():
        ref = FIELDS[ALIASES.get(key, key)]
        (out.setdefault(ref.section, {}) if ref.section else out)[ref.name] = value
    return out


def config_error(*overrides: str, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


# ------------------------------------------------------------------ the flat names and the demo config
def test_every_old_flat_name_is_a_field_in_exactly_one_place():
    assert set(TINY_CPU_FLAT) <= set(FIELDS)  # every old name still loads (fields added since are new names)
    placed = [name for model in SECTIONS.values() for name in model.model_fields]
    top = ("model_name_or_path", "seed", "full_determinism", "output_dir", "trust_remote_code", "model_init_kwargs")
    assert len(placed) == len(set(placed)) == len(FIELDS) - len(top)
    assert [FIELDS[n].section for n in top] == [None] * len(top)
    assert FIELDS["learning_rate"].path == "optim.learning_rate"
    assert FIELDS["vllm_importance_sampling_cap"].path == "off_policy.vllm_importance_sampling_cap"
    assert all(ref.info.description for ref in FIELDS.values()), "every field keeps its description"
    assert all(model.__doc__ for model in SECTIONS.values())


def test_examples_tiny_cpu_yaml_loads_to_the_same_values_as_the_flat_config():
    config = load_config(TINY_CPU)
    flat = flat_dump(config, mode="json")
    assert {k: flat[k] for k in TINY_CPU_FLAT} == TINY_CPU_FLAT
    added = set(flat) - set(TINY_CPU_FLAT)  # fields added after the snapshot: at their defaults, but for the
    set_by_the_demo = {"lr_scheduler_type": "constant", "eval_strategy": "steps", "eval_steps": 200}  # issue 13
    set_by_the_demo["share_prompt_prefix"] = True  # issue 23: each group's prompt through the trainer once
    assert all(flat[k] == set_by_the_demo.get(k, FIELDS[k].default) for k in added), added
    assert config.optim.learning_rate == 3.0e-4 and config.loss.epsilon_high == 0.28 and config.groups_per_step == 16


def test_flat_params_keep_the_old_flat_names_and_values():
    params = flat_params(load_config(TINY_CPU))
    assert list(params) == list(FIELDS) and set(TINY_CPU_FLAT) <= set(params)
    assert {k: params[k] for k in TINY_CPU_FLAT} == {k: str(v) for k, v in TINY_CPU_FLAT.items()}
    assert params["loss_type"] == "dapo" and params["learning_rate"] == "0.0003" and params["eval_dataset"] == "None"


# ------------------------------------------------------------------ flat, nested, dotted and mixed input
def test_flat_yaml_equals_nested_yaml(tmp_path):
    flat = yaml.safe_load(TINY_CPU.read_text())
    as_nested = nested(flat)
    assert set(as_nested) - {"model_name_or_path", "seed", "output_dir"} <= set(SECTIONS)
    assert load_config(write_yaml(tmp_path, as_nested)) == load_config(TINY_CPU)
    assert GRPOConfig(**as_nested) == GRPOConfig(**flat) == load_config(TINY_CPU)


def test_mixed_flat_dotted_and_nested_keys(tmp_path):
    path = write_yaml(
        tmp_path,
        {
            "learning_rate": 2e-5,
            "optim": {"max_steps": 7},
            "loss.loss_type": "grpo",
            "vllm_importance_sampling_clip_max": 4.0,
            "sampling": {"temperature": 0.5},
            "seed": 3,
        },
    )
    config = load_config(path)
    assert (config.optim.learning_rate, config.batch.max_steps, config.loss.loss_type) == (2e-5, 7, "grpo")
    assert config.off_policy.vllm_importance_sampling_cap == 4.0
    assert (config.sampling.temperature, config.seed) == (0.5, 3)
    assert config.optim.weight_decay == 0.0  # the rest of a partly given section keeps its defaults


def test_same_field_twice_with_the_same_value_is_fine():
    config = GRPOConfig(learning_rate=2e-5, optim={"learning_rate": 2e-5})
    assert config.optim.learning_rate == 2e-5


@pytest.mark.parametrize(("data", "first", "second"), [
    ({"learning_rate": 1e-5, "optim": {"learning_rate": 2e-5}}, "learning_rate", "optim.learning_rate"),
    ({"batch.max_steps": 3, "max_steps": 4}, "batch.max_steps", "max_steps"),
    ({"vllm_importance_sampling_cap": 3.0, "vllm_importance_sampling_clip_max": 5.0},
     "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max"),
])  # fmt: skip
def test_conflicting_spellings_of_one_field_are_an_error_naming_both(tmp_path, data, first, second):
    msg = config_error(path=write_yaml(tmp_path, data))
    assert f"{first} and {second} are both given, with different values" in msg
    assert "Fix: keep one of them" in msg
    with pytest.raises(ValidationError, match="both given"):
        GRPOConfig(**data)


def test_override_wins_over_the_file_however_either_spells_the_field(tmp_path):
    path = write_yaml(
        tmp_path,
        {"optim": {"learning_rate": 1e-4}, "max_steps": 9, "off_policy": {"vllm_importance_sampling_clip_max": 4.0}},
    )
    config = load_config(path, ["learning_rate=2e-5", "batch.max_steps=3", "vllm_importance_sampling_cap=6"])
    assert (config.optim.learning_rate, config.batch.max_steps) == (2e-5, 3)
    assert config.off_policy.vllm_importance_sampling_cap == 6.0


def test_dotted_and_section_overrides():
    config = load_config(
        None, ["optim.learning_rate=3e-5", "tracking.run_name=2024", "loss={loss_type: grpo, beta: 0.01}"]
    )
    assert config.optim.learning_rate == 3e-5
    assert config.tracking.run_name == "2024"  # a string field keeps the raw text, dotted too
    assert (config.loss.loss_type, config.loss.beta) == ("grpo", 0.01)
    assert "a section takes a mapping" in config_error("optim=5")


SECTION_VALUES = ["{}", "null", "", "[builtin:calculator]", "builtin:calculator", "adamw_torch", "3"]


def _load_or_error(path=None, overrides=()):
    try:
        return load_config(path, list(overrides))
    except ConfigError:
        return "refused"


@pytest.mark.parametrize("raw", SECTION_VALUES)
@pytest.mark.parametrize("section", list(SECTIONS))
def test_a_section_name_override_reads_as_the_same_yaml_key(tmp_path, section, raw):
    """Issue 28: `key=value` and `key: value` in a file read a section name the same way, whatever the value (a
    mapping or nothing is the section; a list or string the field or TRL name of that name, else refused)."""
    base = {"output_dir": str(tmp_path / "run")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base) + f"{section}: {raw}\n")
    assert _load_or_error(None, [f"output_dir={tmp_path / 'run'}", f"{section}={raw}"]) == _load_or_error(path)


def test_the_names_that_are_both_a_section_and_a_field_or_trl_name():
    """`tools` (TRL's list of tools, in section tools) and `optim` (TRL's optimizer name) are read by their value;
    a new such name must be checked the same way (the test above covers every section)."""
    from async_grpo.config.io import TRL_ONLY

    assert sorted(name for name in SECTIONS if name in FIELDS or name in TRL_ONLY) == ["optim", "tools"]
    assert load_config(None, ["optim=adamw_torch", "optim={learning_rate: 2e-5}"]).optim.learning_rate == 2e-5
    assert "a section takes a mapping" in config_error("loss=[grpo]")


def test_keyword_construction_with_flat_trl_names():
    flat = {
        "learning_rate": 1e-5,
        "max_steps": 5,
        "loss_type": "bnpo",
        "reward_url": "http://reward:8080",
        "output_dir": "runs/x",
    }
    config = GRPOConfig(**flat)
    assert flat_dump(config, exclude_defaults=True) == flat
    assert GRPOConfig.model_validate(flat_dump(config)) == config


# ------------------------------------------------------------------ unknown keys: did you mean
def test_flat_typo_suggests_the_field(tmp_path):
    msg = config_error(path=write_yaml(tmp_path, {"learning_rat": 1e-5}))
    assert "learning_rat: unknown field" in msg and "did you mean `learning_rate`?" in msg and "Fix" in msg


def test_nested_typo_suggests_the_field_in_its_section(tmp_path):
    msg = config_error(path=write_yaml(tmp_path, {"optim": {"learning_rat": 1e-5}}))
    assert "optim.learning_rat: unknown field" in msg and "did you mean `optim.learning_rate`?" in msg


def test_right_name_in_the_wrong_section_and_a_misspelt_section(tmp_path):
    msg = config_error(path=write_yaml(tmp_path, {"loss": {"learning_rate": 1e-5}}))
    assert "loss.learning_rate: unknown field" in msg and "did you mean `optim.learning_rate`?" in msg
    msg = config_error(path=write_yaml(tmp_path, {"optm": {"learning_rate": 1e-5}}))
    assert "optm: unknown field" in msg and "did you mean `optim`?" in msg


def test_override_typos_suggest_the_field():
    msg = config_error("learning_rat=1e-5")
    assert "override 'learning_rat': unknown config field" in msg and "did you mean `learning_rate`?" in msg
    msg = config_error("optim.learning_rat=1e-5")
    assert "'optim.learning_rat'" in msg and "did you mean `optim.learning_rate`?" in msg
    assert "did you mean" not in config_error("no_such_field=1")  # nothing close: no guess


def test_every_error_is_reported_with_its_section_path(tmp_path):
    msg = config_error(path=write_yaml(tmp_path, {"optim": {"max_steps": 0, "learning_rat": 1}, "beta": -1}))
    assert "batch.max_steps:" in msg and "optim.learning_rat: unknown field" in msg and "loss.beta:" in msg


def test_reading_a_flat_name_says_where_the_field_is():
    with pytest.raises(AttributeError, match=r"section 'optim'. Fix: read config.optim.learning_rate"):
        GRPOConfig().learning_rate  # noqa: B018  (migrate-config: keep)
    with pytest.raises(AttributeError, match="no_such_field"):
        GRPOConfig().no_such_field  # noqa: B018
    assert GRPOConfig().seed == 0
    with pytest.raises(AttributeError, match=r"Fix: set config.optim.learning_rate"):
        GRPOConfig().learning_rate = 1e-5  # migrate-config: keep


def test_assigning_sections_and_fields_is_validated():
    config = GRPOConfig()
    config.seed = 5
    config.batch = {"max_steps": 4}
    config.loss = GRPOConfig(loss_type="grpo").loss
    config.sampling.temperature = 0.5
    assert (config.seed, config.batch.max_steps, config.loss.loss_type, config.sampling.temperature) == (
        5,
        4,
        "grpo",
        0.5,
    )
    assert config.batch.num_train_epochs == 3.0  # a section given as a mapping starts from its defaults
    with pytest.raises(ValidationError, match="max_steps"):
        config.batch.max_steps = 0
    with pytest.raises(ValidationError, match="not a multiple of num_generations=3"):
        config.sampling = {"num_generations": 3}  # cross-section checks run on a section assignment


# ------------------------------------------------------------------ out: dumps, copies, pickles, help
def test_dump_is_nested_and_round_trips(tmp_path):
    config = load_config(TINY_CPU, ["learning_rate=3e-5", "vllm_importance_sampling_clip_max=4", "run_name=r1"])
    text = dump_config(config)
    data = yaml.safe_load(text)
    assert list(data) == [*(name for name, ref in FIELDS.items() if ref.section is None), *SECTIONS]
    assert data["optim"]["learning_rate"] == 3e-5 and data["off_policy"]["vllm_importance_sampling_cap"] == 4.0
    assert sum(len(v) if k in SECTIONS else 1 for k, v in data.items()) == len(FIELDS)  # every field
    assert load_config(write_yaml(tmp_path, data)) == config
    assert GRPOConfig.model_validate(config.model_dump()) == config
    assert pickle.loads(pickle.dumps(config)) == config


def test_model_copy_takes_flat_or_nested_keys_and_validates():
    config = GRPOConfig()
    copy = config.model_copy(update={"reward_url": "http://rewards:9000", "optim": {"max_steps": 7}})
    assert copy.rewards.reward_url == "http://rewards:9000" and copy.batch.max_steps == 7
    assert copy.optim.learning_rate == config.optim.learning_rate and config.rewards.reward_url is None
    assert "reward_url" not in copy.__dict__  # not a stray top-level attribute
    with pytest.raises(ValidationError, match="reward_url"):
        config.model_copy(update={"reward_url": "not-a-url"})
    assert config.model_copy() == config


def test_help_lists_every_field_under_its_section_with_default():
    lines = _field_help().splitlines()
    headers = {line.split(":")[0]: i for i, line in enumerate(lines) if line and not line.startswith(" ")}
    order = [headers["(top level)"], *(headers[name] for name in SECTIONS)]
    assert order == sorted(order)
    for ref in FIELDS.values():
        index = next(i for i, line in enumerate(lines) if line.startswith(f"  {ref.name} (default "))
        start = headers[ref.section or "(top level)"]
        assert start < index and not any(start < h < index for h in headers.values()), ref.path
        assert f"(default {ref.default!r}): {ref.info.description}" in lines[index]


def test_flatten_and_lookup_helpers():
    assert lookup_field("optim.learning_rate") is lookup_field("learning_rate") is FIELDS["learning_rate"]
    assert lookup_field("vllm_importance_sampling_clip_max") is FIELDS["vllm_importance_sampling_cap"]
    assert lookup_field("loss.learning_rate") is None and lookup_field("nope") is None
    assert flatten_mapping({"optim": {"learning_rate": 1.0}, "seed": 1, "typo": 2, "optim.typo": 3}) == {
        "learning_rate": 1.0,
        "seed": 1,
        "typo": 2,
        "optim.typo": 3,
    }


def test_fields_that_left_optim_keep_loading_from_their_old_spellings(tmp_path):
    """Issue 49 split `optim` into `batch` (geometry, steps), `optim` (AdamW, schedule) and `compute` (how the learner
    computes): a YAML or override written against the old section keeps loading, into the new one; a conflict between
    the old and the new spelling is refused naming both."""
    path = tmp_path / "old.yaml"
    path.write_text("optim:\n  learning_rate: 2.0e-5\n  max_steps: 7\n  fsdp: true\n  bf16: true\n")
    config = load_config(path, ["optim.per_device_train_batch_size=16", "optim.torch_num_threads=2"])
    assert (config.optim.learning_rate, config.batch.max_steps, config.batch.per_device_train_batch_size) == (
        2e-5,
        7,
        16,
    )
    assert (config.compute.fsdp, config.compute.bf16, config.compute.torch_num_threads) == (True, True, 2)
    assert GRPOConfig(optim={"max_steps": 3}).batch.max_steps == 3
    assert load_config(None, ["batch.max_steps=4"]).batch.max_steps == 4
    dumped = yaml.safe_load(dump_config(config))
    assert dumped["batch"]["max_steps"] == 7 and "max_steps" not in dumped["optim"] and dumped["compute"]["fsdp"]
    with pytest.raises(ValueError, match=r"optim.max_steps and batch.max_steps are both given"):
        GRPOConfig(**{"optim.max_steps": 3, "batch.max_steps": 4})
    with pytest.raises(ValueError, match="loss.max_steps"):  # only the section a field came from is accepted
        GRPOConfig(**{"loss.max_steps": 3})
