"""The layer rules of docs/architecture.md, enforced: each role imports only the roles below it, the step loop holds
the trainer, the reward backends and generation only through their protocols, and no module imports itself back
through others (no import cycles). A module holds one idea however long it is: there is no line limit."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "async_grpo"

# role -> the roles (top-level modules or packages of async_grpo) it may import; itself is always allowed.
# Listed bottom-up, as docs/architecture.md's table.
ALLOWED = {
    "__init__": set(),
    "errors": set(),
    "user_code": set(),
    "checkpoint_layout": set(),
    "worker_warmup": set(),  # starting a pebble pool's spawned workers before the first request (pebble only)
    "shared_volume": set(),  # reading, copying, listing, creating on the tenant-writable volume (stdlib only)
    "config": {"user_code"},
    "hub": set(),
    "dataset_source": set(),
    "tasks": set(),
    "tiny_model": set(),
    "algorithms": set(),
    "inference": set(),
    "data": {"dataset_source", "tasks", "hub"},
    "transports": {"inference"},
    "tools": {"user_code", "worker_warmup"},
    "environments": {"tasks", "tools", "user_code"},
    # agents: the reward service runs the run's agent (agents.loading, .execution, .sandbox, .remote, which import no
    # rewards module: test_no_import_cycles), as it runs the tools
    "rewards": {"__init__", "agents", "config", "hub", "tasks", "tools", "transports", "user_code", "worker_warmup"},
    "orchestrator": {
        "algorithms",
        "data",
        "environments",
        "errors",
        "inference",
        "tasks",
        "tools",
        "transports",
        "user_code",
    },
    # an agent's spec and program, the OpenAI-compatible endpoint, and the rollout that runs the agent (issue 51)
    "agents": {"data", "inference", "orchestrator", "rewards", "tools", "transports", "user_code"},
    # the teacher's client and the training rollout that asks it (on-policy distillation, issue 52)
    "distillation": {"config", "data", "inference", "orchestrator", "transports"},
    "trainer": {"algorithms", "transports"},
    "evaluation": {"data", "inference", "orchestrator", "transports"},
    "tracking": {"config", "shared_volume", "transports"},  # transports: the episode spans a trace draws
    # registry, promotion, lineage, registry_start (a run from a registered version), pipeline_tracking
    "lifecycle": {"__init__", "config", "shared_volume"},
    "step_secrets": set(),  # a KFP step's mounted Secret files -> its environment (stdlib only)
    "preflight": {
        "agents",
        "checkpoint_layout",
        "config",
        "data",
        "environments",
        "hub",
        "lifecycle",
        "rewards",
        "tiny_model",
        "tools",
        "user_code",
    },
    "runner": {
        "agents",
        "algorithms",
        "checkpoint_layout",
        "config",
        "data",
        "dataset_source",
        "distillation",
        "environments",
        "errors",
        "evaluation",
        "hub",
        "inference",
        "lifecycle",
        "orchestrator",
        "rewards",
        "tasks",
        "tiny_model",
        "tools",
        "tracking",
        "trainer",
        "transports",
    },
    "launch": {
        "__init__",
        "config",
        "data",  # the evaluate step reads the held-out prompts; the dataset step loads and splits them
        "dataset_source",  # the dataset step: `{date}` paths, newest-file folders, the digests record
        "errors",
        "evaluation",
        "hub",  # the dataset step: hub ids and their pinned snapshots
        "step_secrets",
        "inference",
        "lifecycle",
        "preflight",
        "rewards",
        "runner",
        "shared_volume",  # the train step stages the dataset and copies the model on the workspace volume
        "tiny_model",  # the dataset step checks prompts with builtin:tiny's tokenizer
        "tracking",
        "trainer",
        "transports",
        "user_code",
    },
    "pipeline_local": {"config", "errors", "launch", "lifecycle", "preflight", "tracking"},
    "cli_render": {"config", "errors", "launch", "preflight"},
    "cli_pipeline": {"config", "errors", "launch", "pipeline_local", "preflight"},
    "cli_model": {"config", "errors", "launch", "lifecycle", "tracking"},  # launch: the policy's registered_models
    "cli": {
        "__init__",
        "cli_model",
        "cli_pipeline",
        "cli_render",
        "config",
        "errors",
        "launch",
        "lifecycle",
        "preflight",
        "runner",  # make-tiny-model --sft-steps: the runner's warm start, saved (`runner.warm_model`)
        "tiny_model",
    },
}

# The step loop (runner/recipe.py) holds each role through its protocol: the names it may import from them.
STEP_LOOP = SRC / "runner" / "recipe.py"
STEP_LOOP_NAMES = {
    "trainer": {"Learner", "DistInfo", "broadcast_parameters"},  # the protocol; where this rank is; rank 0's weights
    # generation: the `Rollout` protocol, and the producer's (`RunProducer`, its `ProducerState`; built by `builders`)
    "orchestrator": {"Rollout", "RunProducer", "ProducerState"},
    "rewards": {"make_reward_pool"},  # the factory of a `transports.scorer.Scorer`; scoring goes through that
}


def _role(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _type_only_imports(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks (never executed)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


def _async_grpo_imports(path: Path, *, runtime_only: bool = False) -> list[tuple[str, str | None]]:
    """(module imported, name imported from it or None) for every import of async_grpo in `path`, relative ones
    resolved, function bodies and TYPE_CHECKING blocks included (a lazy import is still a dependency of the layers);
    `runtime_only` leaves out the TYPE_CHECKING blocks (an import cycle is one that executes)."""
    package = list(path.relative_to(SRC.parent).with_suffix("").parts[:-1])  # the package `path` is in
    out = []
    tree = ast.parse(path.read_text())
    skip = _type_only_imports(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "async_grpo"]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.split(".")[0] == "async_grpo":
                out += [(module, a.name) for a in node.names]
    return out


def _imported_roles(path: Path) -> set[str]:
    roles = set()
    for module, name in _async_grpo_imports(path):
        parts = module.split(".")
        if len(parts) > 1:
            roles.add(parts[1])
        elif name is not None and ((SRC / name).is_dir() or (SRC / f"{name}.py").is_file()):
            roles.add(name)  # `from async_grpo import config`
        else:
            roles.add("__init__")
    return roles


def _sources(role: str) -> list[Path]:
    return [SRC / f"{role}.py"] if (SRC / f"{role}.py").is_file() else sorted((SRC / role).rglob("*.py"))


def test_every_role_is_listed():
    present = {p.name.removesuffix(".py") for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert present == set(ALLOWED), f"roles without a layer rule: {sorted(present - set(ALLOWED))}"


@pytest.mark.parametrize("role", sorted(ALLOWED))
def test_a_role_imports_only_the_roles_below_it(role):
    files = _sources(role)
    assert files, f"no source for role {role}"
    bad = {}
    for path in files:
        crossing = _imported_roles(path) - ALLOWED[role] - {role}
        if crossing:
            bad[str(path.relative_to(SRC))] = sorted(crossing)
    assert not bad, f"imports crossing the role boundary of {role!r} (see docs/architecture.md): {bad}"


def test_no_lower_layer_imports_the_runner_trainer_or_launch():
    lower = ("rewards", "algorithms", "transports", "inference", "tools", "environments", "orchestrator")
    offenders = {
        str(p.relative_to(SRC)): sorted(_imported_roles(p) & {"launch", "runner", "trainer"})
        for role in lower
        for p in (SRC / role).rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_the_step_loop_holds_the_other_roles_through_their_protocols():
    bad = []
    for module, name in _async_grpo_imports(STEP_LOOP):
        role = module.split(".")[1] if "." in module else None
        if role in STEP_LOOP_NAMES and name not in STEP_LOOP_NAMES[role]:
            bad.append(f"{module}.{name}")
    assert not bad, f"runner/recipe.py reaches past the protocols: {bad}"
    text = STEP_LOOP.read_text()
    assert "hasattr(" not in text and "getattr(" not in text, "the step loop probes its collaborators"
    assert "._" not in text.replace("self._", ""), "the step loop touches another object's private attribute"


def _module_graph() -> dict[str, set[str]]:
    """Module -> the async_grpo modules it imports when it runs (a package's `__init__` counts as the package's
    module; a TYPE_CHECKING import, for annotations only, is not an edge)."""
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in modules.items():
        deps = set()
        for imported, name in _async_grpo_imports(path, runtime_only=True):
            target = f"{imported}.{name}" if name and f"{imported}.{name}" in modules else imported
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module:
                deps.add(target)
        graph[module] = deps
    return graph


def test_no_import_cycles():
    graph = _module_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_can_fail(tmp_path, monkeypatch):
    """The graph sees a cycle when there is one (two modules importing each other, one lazily)."""
    pkg = tmp_path / "async_grpo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from async_grpo.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from async_grpo import a\n")
    monkeypatch.setattr(__import__(__name__), "SRC", pkg)
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles()


# getattr/hasattr with a literal name that one of our own classes defines probes an object whose type should say
# whether it has the attribute. Each entry below probes a foreign object (a transformers model or tokenizer, a user's
# environment or producer, argparse, PyYAML) whose attribute happens to share a name with one of ours.
FOREIGN_PROBES = {
    ("cli_model.py", "policy"): "an argparse namespace: only some sub-commands define --policy",
    ("config/io.py", "problem"): "a PyYAML MarkedYAMLError",
    ("orchestrator/producer.py", "config"): "a user data_producer's object, checked before it is trusted",
    ("trainer/flattening.py", "config"): "a transformers model",
    ("trainer/prefix_sharing.py", "config"): "a transformers model",
    ("trainer/policy_setup.py", "config"): "a transformers model",
    ("trainer/distributed.py", "get_decoder"): "a transformers model (not every architecture has a decoder)",
    ("transports/weights/gloo.py", "config"): "vLLM's model inside its worker",
    ("transports/weights/gloo.py", "lm_head"): "vLLM's model inside its worker",
    ("transports/weights/gloo.py", "model"): "vLLM's model inside its worker",
    ("tools/render.py", "pad_token_id"): "a transformers tokenizer",
    ("environments/openenv_adapter.py", "observation"): "an OpenEnv StepResult or observation",
    ("environments/openenv_adapter.py", "reward"): "an OpenEnv StepResult or observation",
    ("environments/openenv_adapter.py", "done"): "an OpenEnv StepResult or observation",
    ("environments/openenv_adapter.py", "close"): "an OpenEnv client (closing is optional there)",
    ("environments/calls.py", "close_episode"): "a user's environment (the method is optional in the protocol)",
    ("environments/calls.py", "close"): "a user's environment (the method is optional in the protocol)",
}


def _our_attribute_names() -> set[str]:
    """Every method, class attribute and `self.x` assignment of a class under src/async_grpo."""
    names = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            for sub in ast.walk(node):
                stored = isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                if stored and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return {n for n in names if not n.startswith("__")}


def test_no_module_probes_our_own_types_with_getattr():
    """A collaborator's type (a protocol, a record) says what it has: `getattr(x, "last_push_bytes", 0)` on one of
    our own objects hides a missing contract (issue 49: the weight push, the prompt ledger, the LoRA learner)."""
    ours = _our_attribute_names()
    probes = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                name = node.args[1] if len(node.args) > 1 else None
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value in ours:
                    probes.add((str(path.relative_to(SRC)), name.value))
    assert not probes - FOREIGN_PROBES.keys(), "probes of our own types; give the type the attribute instead"
    assert not FOREIGN_PROBES.keys() - probes, "FOREIGN_PROBES lists probes that are gone: remove them"


def test_every_component_is_one_call_and_has_a_kfp_local_test():
    """Issue 49: a KFP component is its parameters and one call into the package (the step's order lives in
    `launch/<step>_step.py`, where it is tested), and each component runs once under kfp.local's SubprocessRunner,
    from its IR in a subprocess, as KFP runs it."""
    components = SRC.parents[1] / "components"
    steps = {"train_grpo": "train_step", "evaluate": "evaluate_step", "register_model": "register_step",
             "cleanup": "cleanup_step", "prepare_dataset": "prepare_step"}  # fmt: skip
    folders = sorted(p.parent.name for p in components.glob("*/component.py"))
    assert folders == sorted(steps)
    for name in folders:
        assert "local.SubprocessRunner" in (components / name / "tests" / "test_component.py").read_text(), name
    for name, step in steps.items():
        assert f"from async_grpo.launch.{step} import run_{step}" in (components / name / "component.py").read_text()
