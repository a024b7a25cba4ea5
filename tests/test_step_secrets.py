"""A pipeline step's credentials come from its mounted Secret files into its own environment (async_grpo.step_secrets),
and every step that needs one loads them before anything else."""

from __future__ import annotations

import ast
import inspect
import os

import pytest

from async_grpo.step_secrets import HF_SECRET_KEYS, MLFLOW_SECRET_KEYS, load_step_secrets


def test_mounted_files_become_variables_byte_for_byte(tmp_path, monkeypatch):
    mlflow_dir, hf_dir = tmp_path / "mlflow", tmp_path / "hf"
    mlflow_dir.mkdir()
    hf_dir.mkdir()
    (mlflow_dir / "MLFLOW_TRACKING_URI").write_text("https://mlflow.example:5000")
    (mlflow_dir / "MLFLOW_TRACKING_PASSWORD").write_bytes(b"p\xc3\xa4ss word\n")  # exact bytes, as secretKeyRef
    (mlflow_dir / "OTHER_KEY").write_text("never read")
    (hf_dir / "HF_TOKEN").write_text("hf_abc")
    for key in (*MLFLOW_SECRET_KEYS, *HF_SECRET_KEYS, "OTHER_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "set-before")

    loaded = load_step_secrets(((str(mlflow_dir), MLFLOW_SECRET_KEYS), (str(hf_dir), HF_SECRET_KEYS)))

    assert loaded == ["MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_PASSWORD", "HF_TOKEN"]
    assert os.environ["MLFLOW_TRACKING_URI"] == "https://mlflow.example:5000"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "päss word\n"
    assert os.environ["HF_TOKEN"] == "hf_abc"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "set-before"  # no file, and a set variable is kept anyway
    assert "OTHER_KEY" not in os.environ


def test_no_mount_no_change(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert load_step_secrets(((str(tmp_path / "absent"), HF_SECRET_KEYS),)) == []
    assert "HF_TOKEN" not in os.environ


def test_a_mounted_mlflow_secret_without_its_uri_stops_the_step_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "MLFLOW_TRACKING_PASSWORD").write_text("x")
    with pytest.raises(RuntimeError, match="has no key MLFLOW_TRACKING_URI. Fix: add it"):
        load_step_secrets(((str(tmp_path), MLFLOW_SECRET_KEYS),))


# component -> (module, function) that holds the step's body
STEP_FUNCTIONS = {
    "train_grpo": ("async_grpo.launch.train_step", "run_train_step"),
    "evaluate": ("async_grpo.launch.evaluate_step", "run_evaluate_step"),
    "register_model": ("async_grpo.launch.register_step", "run_register_step"),
    "prepare_dataset": ("async_grpo.launch.prepare_step", "run_prepare_step"),
}


@pytest.mark.parametrize(
    "module", ["train_grpo", "evaluate", "register_model", "prepare_dataset"], ids=lambda m: m.replace("_", "-")
)
def test_each_step_with_a_secret_loads_it_once_after_its_decision(module):
    """Each step loads its credentials in one top-level statement, and only after the statement that decides on the
    run (the platform policy, or for the dataset step the paths it reads): a refused run never has them in its
    process. tests/launch/test_attacks_credentials.py runs each step and records the order."""
    import importlib

    component = getattr(importlib.import_module(f"components.{module}.component"), module)
    step = STEP_FUNCTIONS[module]  # the component's body is one call into the package: read that function
    calls = ast.unparse(ast.parse(inspect.getsource(component.python_func)))
    assert f"{step[1]}(" in calls and "load_step_secrets" not in calls, module
    func = getattr(importlib.import_module(step[0]), step[1])
    body = ast.parse(inspect.getsource(func)).body[0].body
    loads = [
        s
        for s in body
        if isinstance(s, ast.Expr) and ast.unparse(s) in ("load_step_secrets()", "step_secrets.load_step_secrets()")
    ]
    assert len(loads) == 1, module
    before = ast.unparse(ast.Module(body=body[: body.index(loads[0])], type_ignores=[]))
    decisions = (
        ["resolve_dataset_path(dataset_uri, when)", "resolve_dataset_path(eval_dataset_uri, when)",
         "check_tokenizer_path(model_name_or_path)"]
        if module == "prepare_dataset"
        else ["check_step("]
    )  # fmt: skip
    assert all(decision in before for decision in decisions), module
    assert "MlflowClient" not in before and "resolve_registry_start" not in before, module
