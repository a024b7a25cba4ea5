"""`async-grpo model promote|rollback|show`: the champion alias of a registered model, from the command line.

A thin shell over `async_grpo.lifecycle.registry` (which holds the rules: compare-and-set, previous-champion, the tags each
move records). The registry is the tracking server's: `--tracking-uri`, else `MLFLOW_TRACKING_URI`, as every MLflow
tool. A refusal (no such model or version, nothing to roll back to, a champion that moved) exits 2 with
`error: ... Fix: ...` on stderr and no traceback. In a cluster pod, or with `--policy FILE`, the platform policy
decides first: the tracking URI and the model name must be listed there (`check_registry_access`), so a namespace
moves only its own champions.
"""

from __future__ import annotations

import argparse
import getpass
import os
from pathlib import Path

from async_grpo.config import ConfigError
from async_grpo.errors import print_user_error
from async_grpo.launch.k8s_policy import PolicyViolation, in_cluster_pod, step_problems
from async_grpo.launch.platform_policy import load_policy
from async_grpo.lifecycle.registry import (
    ANY,
    CHAMPION_ALIAS,
    RegistryError,
    aliases,
    model_versions,
    previous_alias,
    promote,
    rollback,
)

# The version tags `show` prints, in this order: evaluation, lineage, then the promotion history.
SHOWN_TAGS = (
    "eval_reward",
    "parent_version",
    "base_model",
    "kfp.run_name",
    "promoted_by",
    "promoted_at",
    "promoted_from",
    "promotion_reason",
    "rolled_back_by",
    "rolled_back_at",
    "rollback_reason",
)
NO_CHAMPION = "none"  # `--expected-champion none`: promote only when no version holds the alias


def tracking_uri(given: str | None) -> str:
    """The registry's tracking URI: `given` (`--tracking-uri`), else `MLFLOW_TRACKING_URI`.

    Raises:
        RegistryError: neither is set, or a sqlite store that does not exist (MLflow would create an empty one and
            report every model as unknown).
    """
    uri = given or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri:
        raise RegistryError(
            "no tracking URI: the registry lives on the MLflow tracking server. "
            "Fix: pass --tracking-uri URI or set MLFLOW_TRACKING_URI."
        )
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///").split("?", 1)[0]).is_file():
        raise RegistryError(f"tracking URI {uri}: no MLflow store at that path. Fix: give the run's store.")
    return uri


def check_registry_access(args: argparse.Namespace, action: str) -> None:
    """In a cluster pod (a pipeline step, a notebook of the namespace), or with `--policy FILE`, the platform policy's
    decision before the registry is touched: the tracking URI must be one of its `mlflow_tracking_uris` and the
    registered model one of its `registered_models` (`k8s_policy.step_problems`, as the pipeline's steps judge them):
    every run of a namespace shares one MLflow user, so the registry itself cannot keep one team from moving another
    team's champion. Elsewhere (a laptop with the user's own credentials) nothing is checked.

    Args:
        args: the parsed command line (`name`, `tracking_uri`, `policy`).
        action: what the command does to the model ("promote", "roll back", "read").

    Raises:
        PolicyViolation: the URI or the name is not allowed (the message names the field and the fix).
        ConfigError: the policy file is missing or invalid.
        RegistryError: no tracking URI is given.
    """
    policy_file = getattr(args, "policy", None)
    if not policy_file and not in_cluster_pod():
        return
    policy, source = load_policy(policy_file)
    problems = step_problems(
        policy, tracking_uri=tracking_uri(args.tracking_uri), registered_models=[(args.name, action)]
    )
    if problems:
        raise PolicyViolation(f"the platform policy ({source}) refuses this:\n  " + "\n  ".join(problems))


def _client(given: str | None):
    """An MlflowClient on the registry of the chosen tracking URI (the store opened as the trainer opens it)."""
    import mlflow

    from async_grpo.tracking import open_store

    uri = tracking_uri(given)
    open_store(uri)
    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)


def _printable(value: object) -> str:
    """`value` as text with control characters escaped (tags are written by anyone with registry access)."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(value))


def _cmd_promote(args: argparse.Namespace) -> int:
    expected = ANY
    if args.expected_champion is not None:
        expected = None if args.expected_champion.lower() == NO_CHAMPION else args.expected_champion
    try:
        check_registry_access(args, "promote")
        done = promote(
            _client(args.tracking_uri),
            args.name,
            args.version,
            reason=args.reason,
            actor=args.actor or getpass.getuser(),
            alias=args.alias,
            expected_champion=expected,
        )
    except (RegistryError, ConfigError, PolicyViolation) as err:
        return print_user_error(err)
    if done.previous == done.version:
        print(f"{_printable(done.name)} version {done.version} already holds {done.alias!r}; nothing moved")
    else:
        before = f"version {done.previous}" if done.previous else "no version"
        print(f"{_printable(done.name)}: {done.alias!r} moved from {before} to version {done.version}")
    return 0


def _cmd_rollback(args: argparse.Namespace) -> int:
    try:
        check_registry_access(args, "roll back")
        done = rollback(
            _client(args.tracking_uri),
            args.name,
            reason=args.reason,
            actor=args.actor or getpass.getuser(),
            alias=args.alias,
        )
    except (RegistryError, ConfigError, PolicyViolation) as err:
        return print_user_error(err)
    before = f"version {done.previous}" if done.previous else "no version"
    print(f"{_printable(done.name)}: {done.alias!r} rolled back from {before} to version {done.version}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    try:
        check_registry_access(args, "read")
        client = _client(args.tracking_uri)
        versions = model_versions(client, args.name)
        held = aliases(client, args.name)
    except (RegistryError, ConfigError, PolicyViolation) as err:
        return print_user_error(err)
    by_version: dict[str, list[str]] = {}
    for alias, version in held.items():
        by_version.setdefault(version, []).append(alias)
    print(f"registered model {_printable(args.name)}")
    for alias in (args.alias, previous_alias(args.alias)):
        print(f"  {alias}: {held.get(alias, '(none)')}")
    for v in versions:
        names = ", ".join(sorted(by_version.get(str(v.version), [])))
        print(f"version {v.version}{f' [{names}]' if names else ''} {v.status} run {v.run_id or '-'}")
        for key in SHOWN_TAGS:
            if key in v.tags:
                print(f"  {key}: {_printable(v.tags[key]) or '-'}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `model promote|rollback|show` to the `async-grpo` command line."""
    model = subparsers.add_parser("model", help="the registered model's champion: promote, roll back, show")
    sub = model.add_subparsers(dest="model_command", required=True)

    def common(p: argparse.ArgumentParser, *, moves: bool) -> None:
        p.add_argument("name", help="the registered model's name")
        p.add_argument("--tracking-uri", help="the MLflow tracking server (default: MLFLOW_TRACKING_URI)")
        p.add_argument("--alias", default=CHAMPION_ALIAS, help=f"the alias (default {CHAMPION_ALIAS})")
        p.add_argument(
            "--policy",
            help="platform policy YAML (a copy of ConfigMap async-grpo-policy's policy.yaml): refuse a tracking URI "
            "or model name it does not list; in a cluster pod the policy is always checked ($ASYNC_GRPO_POLICY_FILE, "
            "else the mounted ConfigMap, else the built-in defaults)",
        )
        if moves:
            p.add_argument("--reason", default="", help="why, recorded on the version (one line)")
            p.add_argument("--actor", help="who, recorded on the version (default: your user name)")

    p = sub.add_parser("promote", help="move the champion alias to VERSION (the old one becomes previous-champion)")
    common(p, moves=True)
    p.add_argument("version", help="the version to promote, e.g. 3")
    p.add_argument(
        "--expected-champion",
        metavar="VERSION|none",
        help="promote only if the champion is still this version ('none': no champion yet); exit 2 otherwise",
    )
    p.set_defaults(func=_cmd_promote)
    p = sub.add_parser("rollback", help="give the champion alias back to the previous-champion version")
    common(p, moves=True)
    p.set_defaults(func=_cmd_rollback)
    p = sub.add_parser("show", help="the champion, the previous champion, and every version with its tags")
    common(p, moves=False)
    p.set_defaults(func=_cmd_show)
