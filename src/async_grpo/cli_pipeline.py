"""`async-grpo pipeline compile|submit|schedule|run-local`: the KFP pipeline from the command line.

`submit` and `schedule` wrap `kfp.Client` (`create_run_from_pipeline_package`, `create_recurring_run`);
`run-local` runs the same compiled pipeline through `kfp.local`. Arguments are given the way `train`
takes overrides: a config YAML and `key=value` items, each routed to the pipeline parameter of that
name, or, for config fields without one, to `extra_overrides`; values are typed by the compiled IR.
`submit` and `schedule` check a kubernetes run against the platform policy first (`check_submission`),
the same check the train step makes on the cluster, so a refused run fails here, before KFP sees it; then
they run the cluster preflight (`async_grpo.preflight`, target cluster) on the config the train step will build;
`run-local` runs the local preflight before any step.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from async_grpo.config import ConfigError, GRPOConfig, flatten_mapping, load_config, lookup_field
from async_grpo.errors import print_user_error
from async_grpo.launch.k8s_policy import PolicyViolation, prepare_run, work_dir_problems
from async_grpo.launch.k8s_settings import ClusterSettings
from async_grpo.launch.platform_policy import PlatformPolicy, load_policy
from async_grpo.pipeline_local import (
    DEFAULT_OUTPUT_DIR,
    find_repo_root,
    import_pipeline_module,
    new_invocation_dir,
    pipeline_parameters,
    run_local_pipeline,
)
from async_grpo.preflight import check_config

GPU_PACKAGE = "pipelines/grpo_pipeline.yaml"
CPU_PACKAGE = "pipelines/grpo_pipeline_cpu.yaml"
DEFAULT_EXPERIMENT = "async-grpo"
DEFAULT_SCHEDULE_NAME = "async-grpo-retrain"
_TYPES = {"NUMBER_INTEGER": int, "NUMBER_DOUBLE": float, "BOOLEAN": bool, "LIST": list, "STRUCT": dict}


def make_client(host: str | None, namespace: str | None) -> Any:
    """A `kfp.Client` for `host` (None: in-cluster or kube-context discovery) in `namespace` (None: kfp's default)."""
    import kfp

    kwargs = {"host": host} if host else {}
    if namespace:
        kwargs["namespace"] = namespace
    return kfp.Client(**kwargs)


def _typed(name: str, raw: str, parameter_type: str) -> Any:
    """Parse `raw` for a pipeline parameter of IR type `parameter_type` (STRING keeps the raw text)."""
    if parameter_type == "STRING":
        return raw
    expected = _TYPES.get(parameter_type)
    if expected in (int, float):
        try:
            return expected(raw.strip())  # float("1e-5") works where YAML 1.1 reads a string
        except ValueError:
            raise ConfigError(
                f"pipeline parameter {name}={raw!r} is not a {parameter_type.lower()}. Fix: give one."
            ) from None
    value = yaml.safe_load(raw)
    if expected is not None and not isinstance(value, expected):
        raise ConfigError(f"pipeline parameter {name}={raw!r} is not a {parameter_type.lower()}. Fix: give one.")
    return value


def pipeline_arguments(params: dict[str, dict[str, Any]], config_path: str | None, items: list[str]) -> dict[str, Any]:
    """Pipeline arguments from a GRPOConfig YAML file and `key=value` items.

    A config key that names a pipeline parameter becomes that argument; the other keys become the
    `config_yaml` argument. An item naming a pipeline parameter is typed by `params` (IR types);
    an item naming a config field without a parameter is appended to `extra_overrides`.

    Raises:
        ConfigError: the config or an item is invalid (validated as a GRPOConfig first), an item is
            not key=value, names neither a parameter nor a config field, or has the wrong type.
    """
    config_items = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{item!r} is not key=value. Fix: write e.g. max_steps=20.")
        if lookup_field(item.split("=", 1)[0]) is not None:
            config_items.append(item)
    load_config(config_path, config_items)  # fail here, naming the field, before anything is submitted
    args: dict[str, Any] = {}
    if config_path:
        rest = {}
        for key, value in flatten_mapping(yaml.safe_load(Path(config_path).read_text()) or {}).items():
            if key in params and lookup_field(key) is not None:
                kind = params[key]["parameterType"]
                if value is None and kind == "STRING":
                    value = ""  # the pipeline's "unset"
                args[key] = float(value) if kind == "NUMBER_DOUBLE" else value
            else:
                rest[key] = value
        args["config_yaml"] = yaml.safe_dump(rest, sort_keys=False)
    extra: list[str] = []
    for item in items:
        key, raw = item.split("=", 1)
        ref = lookup_field(key)
        key = ref.name if ref is not None else key.strip()
        if key in params:
            args[key] = _typed(key, raw, params[key]["parameterType"])
        elif ref is not None:
            extra.append(f"{key}={raw}")
        else:
            raise ConfigError(
                f"{key!r} is neither a pipeline parameter nor a config field. "
                f"Fix: use one of {sorted(params)} or a GRPOConfig field."
            )
    if extra:
        args["extra_overrides"] = list(args.get("extra_overrides", [])) + extra
    return args


def _argument(name: str, arguments: dict[str, Any], params: dict[str, dict[str, Any]]) -> Any:
    return arguments.get(name, params.get(name, {}).get("defaultValue"))


def submitted_config(params: dict[str, dict[str, Any]], arguments: dict[str, Any]) -> GRPOConfig:
    """The GRPOConfig the train step will build from `arguments`, merged as it merges them
    (`launch.pipeline_step.resolve_run_config`: config_yaml, then the typed knobs that are config fields, then
    extra_overrides); the dataset and folders, which the pipeline sets, keep their defaults.

    Raises:
        ConfigError: the merged config is invalid.
    """
    from async_grpo.launch.pipeline_step import resolve_run_config

    knobs = {
        name: _argument(name, arguments, params)
        for name in params
        if lookup_field(name) is not None and name not in ("dataset", "eval_dataset", "run_name")
    }
    return resolve_run_config(
        str(_argument("config_yaml", arguments, params) or ""),
        knobs,
        list(_argument("extra_overrides", arguments, params) or []),
    )


def preflight_config(params: dict[str, dict[str, Any]], arguments: dict[str, Any]) -> GRPOConfig:
    """`submitted_config` with the pipeline's `dataset` / `eval_dataset` arguments in place (a `file://` URI as its
    path), so preflight checks the data the run will read (`prepare_dataset` reads the same).

    Raises:
        ConfigError: the merged config is invalid.
    """
    check_gate_arguments(params, arguments)
    config = submitted_config(params, arguments)
    update = {}
    for name in ("dataset", "eval_dataset"):
        value = str(_argument(name, arguments, params) or "")
        if value:
            update[name] = value.removeprefix("file://")
    return config.model_copy(update=update) if update else config


def check_gate_arguments(params: dict[str, dict[str, Any]], arguments: dict[str, Any]) -> None:
    """The retraining parameters that no GRPOConfig field checks (`warm_start`, `promotion_confidence`,
    `min_improvement`), checked before a run is submitted rather than after it has trained.

    Raises:
        ConfigError: a value out of range, naming the parameter and the fix.
    """
    import math

    problems = []
    if "warm_start" in params and _argument("warm_start", arguments, params) not in ("none", "champion"):
        problems.append(f"warm_start={_argument('warm_start', arguments, params)!r}: Fix: none or champion.")
    if "promotion_confidence" in params:
        confidence = float(_argument("promotion_confidence", arguments, params))
        if not 0.0 < confidence < 1.0:
            problems.append(f"promotion_confidence={confidence}: not in (0, 1). Fix: e.g. 0.95.")
    if "min_improvement" in params and not math.isfinite(float(_argument("min_improvement", arguments, params))):
        problems.append("min_improvement: not a finite number. Fix: e.g. 0 (any improvement the interval shows).")
    if problems:
        raise ConfigError("invalid retraining parameters:\n" + "\n".join(f"  {p}" for p in problems))


def check_submission(
    params: dict[str, dict[str, Any]], arguments: dict[str, Any], policy: PlatformPolicy, namespace: str | None = None
) -> None:
    """Refuse a kubernetes run the platform policy does not allow, before it is submitted: the run config and
    `kubernetes_options`, as the train step checks them (`k8s_policy.prepare_run`). The Secrets and volume the
    pipeline's own steps mount are compiled into the pipeline (`PipelineWiring`), not run parameters. Other
    backends: no check.

    Raises:
        PolicyViolation: what is not allowed, each with the field and the fix.
        ConfigError: the arguments do not make a valid config or valid cluster settings.
    """
    if _argument("launch_backend", arguments, params) != "kubernetes":
        return
    options = dict(_argument("kubernetes_options", arguments, params) or {})
    if namespace and "namespace" not in options:
        options["namespace"] = namespace
    work_dir = _argument("work_dir", arguments, params)
    problems = [] if not work_dir else work_dir_problems(str(work_dir))
    try:
        prepare_run(submitted_config(params, arguments), ClusterSettings.from_mapping(options), policy)
    except PolicyViolation as err:
        problems += str(err).splitlines()[1:]
    if problems:
        raise PolicyViolation("the platform policy refuses this run:\n  " + "\n  ".join(p.strip() for p in problems))


def kfp_cron(expression: str) -> str:
    """KFP's six-field cron (seconds first) from a five- or six-field expression.

    Raises:
        ValueError: not 5 or 6 whitespace-separated fields.
    """
    fields = expression.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    if len(fields) != 6:
        raise ValueError(
            f"cron {expression!r} has {len(fields)} fields. Fix: give 5 (min hour dom mon dow), e.g. "
            "'0 3 * * 1' for Mondays at 03:00, or KFP's 6 with seconds first."
        )
    return " ".join(fields)


def _package(args: argparse.Namespace) -> Path:
    if args.package:
        return Path(args.package)
    return find_repo_root() / (CPU_PACKAGE if args.cpu else GPU_PACKAGE)


def _cmd_compile(args: argparse.Namespace) -> int:
    module = import_pipeline_module()  # puts the checkout on sys.path
    from components import ASYNC_GRPO_CPU_IMAGE, ASYNC_GRPO_IMAGE

    if args.output:
        targets = {Path(args.output): not args.cpu}
    else:
        targets = {find_repo_root() / path: gpu for path, gpu in ((GPU_PACKAGE, True), (CPU_PACKAGE, False))}
    wiring = module.PipelineWiring(
        mlflow_secret=args.mlflow_secret, hf_token_secret=args.hf_token_secret, workspace_pvc=args.workspace_pvc
    )
    for path, gpu in targets.items():
        module.compile_pipeline(path, gpu=gpu, wiring=wiring)
        if args.image:
            text = path.read_text()
            for image in (ASYNC_GRPO_IMAGE, ASYNC_GRPO_CPU_IMAGE):
                text = text.replace(f"image: {image}", f"image: {args.image}")
            path.write_text(text)
        print(f"wrote {path}")
    return 0


def _checked_arguments(args: argparse.Namespace, package: Path) -> dict[str, Any]:
    params = pipeline_parameters(package)
    arguments = pipeline_arguments(params, args.config, args.items)
    policy, source = load_policy(args.policy)
    check_submission(params, arguments, policy, args.namespace)
    print(f"the run passes the platform policy ({source})")
    check_config(preflight_config(params, arguments), target="cluster")  # raises PreflightError (exit 2)
    return arguments


def _cmd_submit(args: argparse.Namespace) -> int:
    package = _package(args)
    arguments = _checked_arguments(args, package)
    client = make_client(args.host, args.namespace)
    result = client.create_run_from_pipeline_package(
        str(package), arguments=arguments, run_name=args.run_name, experiment_name=args.experiment,
        namespace=args.namespace, enable_caching=False, service_account=args.service_account,
    )  # fmt: skip
    print(f"submitted run {result.run_id} (experiment {args.experiment}) from {package}")
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    package = _package(args)
    cron = kfp_cron(args.cron)
    arguments = _checked_arguments(args, package)
    client = make_client(args.host, args.namespace)
    experiment = client.create_experiment(args.experiment, namespace=args.namespace)
    job = client.create_recurring_run(
        experiment_id=experiment.experiment_id, job_name=args.name, cron_expression=cron,
        pipeline_package_path=str(package), params=arguments, max_concurrency=args.max_concurrency,
        no_catchup=not args.catchup, enable_caching=False, service_account=args.service_account,
    )  # fmt: skip
    print(f"scheduled {args.name!r} ({cron}) as recurring run {job.recurring_run_id} in experiment {args.experiment}")
    return 0


def _cmd_run_local(args: argparse.Namespace) -> int:
    module = import_pipeline_module()
    invocation = new_invocation_dir(args.output_dir)  # its own IR file and kfp.local root: runs may overlap
    package = module.compile_pipeline(invocation / "grpo_pipeline_cpu.yaml", gpu=False, for_kfp_local=True)
    try:
        params = pipeline_parameters(package)
        arguments = pipeline_arguments(params, args.config, args.items)
        # the local checks, before any step runs (the pipeline sets output_dir under --output-dir)
        check_config(preflight_config(params, arguments), target="local", skip=["output_dir"])
        result = run_local_pipeline(arguments, args.output_dir, package_path=package, invocation_dir=invocation)
    except Exception:
        if [p.name for p in invocation.iterdir()] == [package.name]:  # refused before anything ran: leave no trace
            shutil.rmtree(invocation.parent if len(list(invocation.parent.iterdir())) == 1 else invocation)
        raise
    reward = "n/a" if result.eval_reward is None else f"{result.eval_reward:.4f}"
    registered = (
        f"{result.registered_model_name} version {result.model_version} "
        f"(models:/{result.registered_model_name}/{result.model_version})"
        if result.model_version
        else f"not registered ({result.decision}); champion: "
        + (f"version {result.champion_version}" if result.champion_version else "none")
    )
    print(f"\nasync-grpo pipeline run {result.run_name!r} finished in {result.wall_s:.0f} s")
    print(f"  MLflow run        {result.mlflow_run_id} (experiment {result.experiment_name})")
    for line in training_headline(result.tracking_uri, result.mlflow_run_id):
        print(f"  {line}")
    print(f"  held-out reward   {reward} (final_eval/reward, the evaluate step)")
    print(f"  promotion gate    {result.decision or 'n/a'}")
    print(f"  registered model  {registered}")
    print(f"  KFP local outputs {result.pipeline_root}")
    print(f"  look at it        {result.mlflow_ui_command}")
    return 0


def training_headline(tracking_uri: str, run_id: str) -> list[str]:
    """Lines summarizing the training run from its MLflow metrics: held-out reward before -> after
    (`eval/reward` at the first and last step), steps/s, weight syncs, trainer idle fraction."""
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri)
    evals = sorted(client.get_metric_history(run_id, "eval/reward"), key=lambda m: m.step)
    metrics = client.get_run(run_id).data.metrics
    lines = []
    if len(evals) >= 2:
        lines.append(
            f"training eval     held-out reward {evals[0].value:.3f} (step {evals[0].step}) -> "
            f"{evals[-1].value:.3f} (step {evals[-1].step})"
        )
    if "summary/steps_per_s" in metrics:
        syncs = len(client.get_metric_history(run_id, "weight_sync/seconds"))
        lines.append(
            f"training speed    {metrics['summary/steps_per_s']:.2f} steps/s, {syncs} weight syncs x "
            f"{metrics.get('summary/weight_sync_s_mean', float('nan')):.3f} s, trainer idle "
            f"{100 * metrics.get('summary/trainer_idle_fraction', float('nan')):.0f} %"
        )
    return lines


def _guard(func):
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (ConfigError, ValueError, FileNotFoundError) as err:
            return print_user_error(err)
        except (RuntimeError, LookupError) as err:  # a pipeline task failed; its log is above
            print(f"error: {err}", file=sys.stderr)
            return 1

    return run


def _add_arguments_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="GRPOConfig YAML: keys that are pipeline parameters set them, the rest go into config_yaml"
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="key=value",
        help="a pipeline parameter, or a config field (routed to extra_overrides)",
    )


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="KFP API endpoint, e.g. http://localhost:8080 (default: kfp's discovery)")
    p.add_argument("--namespace", help="Kubeflow profile namespace (multi-user installs)")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="KFP experiment name")
    p.add_argument("--service-account", help="service account for the run's pods (needs the async-grpo Role)")
    p.add_argument("--package", help=f"compiled pipeline (default: {GPU_PACKAGE}, or {CPU_PACKAGE} with --cpu)")
    p.add_argument("--cpu", action="store_true", help="use the CPU flavour (no GPU for the evaluation pod)")
    p.add_argument(
        "--policy",
        help="platform policy YAML to check a kubernetes run against before submitting (a "
        "copy of ConfigMap async-grpo-policy); default: $ASYNC_GRPO_POLICY_FILE, else "
        "the built-in defaults",
    )
    _add_arguments_options(p)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `pipeline compile|submit|schedule|run-local` to the `async-grpo` parser's subparsers.

    Each leaf parser sets `func(args) -> int` (exit code; 2 for a usage or config error).
    """
    pipeline = subparsers.add_parser("pipeline", help="compile, submit, schedule or locally run the KFP pipeline")
    sub = pipeline.add_subparsers(dest="pipeline_command", required=True)

    p = sub.add_parser("compile", help="write the compiled pipeline IR (both flavours into pipelines/ by default)")
    p.add_argument("-o", "--output", help="write one flavour here instead")
    p.add_argument("--cpu", action="store_true", help="with -o: the CPU flavour")
    p.add_argument("--image", help="replace the component image (a mirror of the project image)")
    p.add_argument(
        "--mlflow-secret",
        default="mlflow-tracking",
        help="Secret with MLFLOW_TRACKING_URI (and optional "
        "credentials) that the train, evaluate and register steps mount; compiled in, not a run parameter",
    )
    p.add_argument(
        "--hf-token-secret",
        default="hf-token",
        help="Secret with HF_TOKEN (optional key) that the dataset step mounts; compiled in",
    )
    p.add_argument(
        "--workspace-pvc", default="async-grpo-workspace", help="PVC the steps mount at /workspace; compiled in"
    )
    p.set_defaults(func=_guard(_cmd_compile))

    p = sub.add_parser("submit", help="start one run on Kubeflow Pipelines (kfp.Client)")
    _add_cluster_options(p)
    p.add_argument("--run-name", help="KFP run name (default: kfp's)")
    p.set_defaults(func=_guard(_cmd_submit))

    p = sub.add_parser("schedule", help="create a recurring run (scheduled retraining)")
    _add_cluster_options(p)
    p.add_argument(
        "--cron",
        required=True,
        help="cron expression, 5 fields ('0 3 * * 1': Mondays 03:00) or KFP's 6 (seconds first)",
    )
    p.add_argument("--name", default=DEFAULT_SCHEDULE_NAME, help="recurring run name")
    p.add_argument("--max-concurrency", type=int, default=1, help="runs of this schedule allowed at once")
    p.add_argument("--catchup", action="store_true", help="run missed intervals after a pause (default: skip them)")
    p.set_defaults(func=_guard(_cmd_schedule))

    p = sub.add_parser("run-local", help="run the whole pipeline here (kfp.local, local backend, real vLLM)")
    p.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help="runs, MLflow store and kfp.local outputs")
    _add_arguments_options(p)
    p.set_defaults(func=_guard(_cmd_run_local))
