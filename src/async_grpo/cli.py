"""The `async-grpo` command line: `train`, `validate`, `make-tiny-model`, `render` (Kubernetes objects),
`pipeline` (KFP) and `model` (the registry's champion).

User errors (a bad config, dataset, path or service: `ConfigError` and the `ValueError`s that name a field and a
fix) exit with code 2 and `error: <field>: <message>. Fix: ...` lines, without a traceback; anything else is a bug
and keeps its traceback."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
from pathlib import Path

from async_grpo import __version__
from async_grpo.config import ConfigError, load_config
from async_grpo.errors import RunFailedError, print_user_error
from async_grpo.preflight import CHECKS, PreflightError


def _field_help() -> str:
    """Every config field, grouped by section, with its default and description."""
    from async_grpo.config import FIELDS, SECTIONS

    lines = [
        "config fields, by section. In YAML give them flat (`learning_rate: 1e-5`, TRL names) or nested",
        "(`optim: {learning_rate: 1e-5}`); override them as `learning_rate=1e-5` or `optim.learning_rate=1e-5`.",
    ]
    for section, doc in [(None, "top level"), *((name, model.__doc__ or "") for name, model in SECTIONS.items())]:
        lines.append("")
        lines.append(f"{section}: {doc.strip()}" if section else f"({doc})")
        for ref in FIELDS.values():
            if ref.section == section:
                lines.append(f"  {ref.name} (default {ref.default!r}): {ref.info.description or ''}")
    return "\n".join(lines)


def _dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to stderr, so a hung run explains itself. Not where stderr is
    no real file (the CLI called in-process under a capturing test runner)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        pass


def _cmd_train(args: argparse.Namespace) -> int:
    _dump_stacks_on_sigusr1()
    overrides = list(args.overrides)
    if args.vllm_url:
        overrides.append(f"vllm_url={args.vllm_url}")
    from async_grpo.lifecycle.registry import RegistryError
    from async_grpo.lifecycle.registry_start import resolve_registry_start
    from async_grpo.preflight import check_config

    try:
        config = load_config(args.config, overrides)
        config, _ = resolve_registry_start(config)  # a models:/ URI becomes the downloaded registry version
        check_config(config, target="local")  # before the heavy imports below, and before any process starts
    except (ConfigError, RegistryError) as err:
        return print_user_error(err)
    from async_grpo.launch.local import run_local

    try:
        summary = run_local(config, skip_checks=CHECKS)  # preflight passed just above
    except ValueError as err:  # bad data / model / reward spec: a user error, shown without a traceback
        return print_user_error(err)
    except RunFailedError as err:  # a dependency failed for good: the message names it and the fix
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; all child processes stopped", file=sys.stderr)
        return 130
    if summary is not None:  # None on trainer ranks > 0: rank 0 reports the run
        _print_summary(summary)
    return 0


def _print_summary(s) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="async-grpo run summary", show_header=False)
    before, after = s.eval_before.get("eval/reward"), s.eval_after.get("eval/reward")
    if before is not None and after is not None:
        table.add_row("held-out reward (before -> after)", f"{before:.3f} -> {after:.3f}")
    if "eval_no_tools/reward" in s.eval_after:  # a tool-calling run: the final model with and without its tools
        table.add_row("held-out reward, final model without tools", f"{s.eval_after['eval_no_tools/reward']:.3f}")
    for key, label in (
        ("eval/tools/call_frequency", "tool calls per completion"),
        ("eval/tools/failure_frequency", "tool-call failures per call"),
    ):
        if key in s.eval_before and key in s.eval_after:
            table.add_row(f"{label} (before -> after)", f"{s.eval_before[key]:.3f} -> {s.eval_after[key]:.3f}")
    table.add_row("steps", f"{s.steps} in {s.train_s:.1f} s ({s.steps_per_s:.2f} steps/s)")
    table.add_row("wall time", f"{s.wall_s:.1f} s")
    table.add_row("generation", f"{s.generation_tokens_per_s:.0f} tokens/s")
    table.add_row("weight syncs", f"{s.weight_syncs} x {s.weight_sync_s_mean:.3f} s")
    table.add_row("trainer idle", f"{100 * s.trainer_idle_fraction:.0f} %")
    table.add_row("dropped groups", str(s.dropped_groups or "none"))
    if s.prompts_lost is not None:
        table.add_row("prompts lost (neither trained nor dropped)", str(s.prompts_lost))
    table.add_row("final model", str(s.model_dir))
    if s.summary_plot:
        table.add_row("summary figure", s.summary_plot)
    table.add_row("MLflow run", s.run_id)
    table.add_row("look at it", f"mlflow ui --backend-store-uri {s.tracking_uri}")
    Console().print(table)


def _cmd_validate(args: argparse.Namespace) -> int:
    from async_grpo.preflight import preflight

    cluster_flags = args.policy or args.settings or args.set
    if cluster_flags and args.target != "cluster":
        return print_user_error(
            ConfigError("--policy, --settings and --set check a cluster run. Fix: add --target cluster.")
        )
    source = None
    try:
        if args.target == "cluster":  # exactly what `render` checks, the policy first (cli_render.check_cluster_run)
            from async_grpo.cli_render import check_cluster_run, load_cluster_run, warn_placeholders

            config, settings, policy, source = load_cluster_run(args)
            resolved, report = check_cluster_run(config, settings, policy, skip=args.skip)
            warn_placeholders(resolved)
        else:
            config = load_config(args.config, list(args.overrides))
            report = preflight(config, target=args.target, skip=args.skip)
    except (ConfigError, ValueError) as err:  # PolicyViolation and PreflightError are ValueErrors
        return print_user_error(err)
    if not report.ok:
        return print_user_error(PreflightError(report.problems))
    policy_note = f" and the platform policy ({source})" if source else ""
    print(f"OK: {args.config} passes {len(report.checked)} preflight checks{policy_note} for a {args.target} run")
    for note in report.skipped:
        print(f"  not checked: {note}")
    return 0


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    if args.sft_steps == 0:
        from async_grpo.tiny_model import build_tiny_model

        path = build_tiny_model(args.out_dir, seed=args.seed)
        print(f"tiny model written to {path}")
        return 0
    from async_grpo.config import GRPOConfig
    from async_grpo.runner.warm_model import save_warm_started_model

    out = Path(args.out_dir)
    try:
        config = GRPOConfig(
            model_name_or_path="builtin:tiny", dataset=args.dataset, seed=args.seed, output_dir=str(out / "build"),
            warmup_sft_steps=args.sft_steps, warmup_sft_learning_rate=args.sft_learning_rate, torch_num_threads=None,
        )  # fmt: skip
        folder, metrics = save_warm_started_model(config, out)
    except ValueError as err:
        return print_user_error(err)
    print(
        f"tiny model trained {args.sft_steps} supervised steps on {args.dataset} written to {folder}: held-out "
        f"sequence accuracy {metrics.get('warmup/heldout_sequence_accuracy', float('nan')):.3f}, "
        f"{metrics['warmup/seconds']:.0f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `async-grpo` console script. Returns the process exit code."""
    parser = argparse.ArgumentParser(prog="async-grpo", description="Asynchronous GRPO on vLLM.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "train", help="run a GRPO job", epilog=_field_help(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", help="YAML config, e.g. examples/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides (values parsed as YAML)")
    p.add_argument("--vllm-url", help="attach to a running vLLM server instead of starting one")
    p.set_defaults(func=_cmd_train)
    p = sub.add_parser(
        "validate",
        help="check a config and its dataset, reward functions and services without "
        "starting anything (exit 0: OK, 2: errors)",
    )
    p.add_argument("config", help="YAML config, e.g. examples/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides (values parsed as YAML)")
    p.add_argument(
        "--target",
        choices=["local", "cluster"],
        default="local",
        help="where the run will execute: local (default) checks this machine too (model folder, "
        "output_dir, device, MLflow, reward service); cluster checks only what does not depend on it",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=list(CHECKS),
        metavar="CHECK",
        help=f"a check not to run (repeatable): one of {', '.join(CHECKS)}",
    )
    from async_grpo import cli_model, cli_pipeline, cli_render

    cli_render.add_cluster_arguments(p)  # with --target cluster: the platform policy and settings, as `render`
    p.set_defaults(func=_cmd_validate)
    p = sub.add_parser("make-tiny-model", help="build the tiny char-level Qwen2-style model locally")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="then train it this many supervised steps on --dataset's reference answers (the run's warm start, "
        "longer: e.g. a distillation teacher, examples/distill_cpu.yaml); 0 (default): untrained",
    )
    p.add_argument("--sft-learning-rate", type=float, default=1e-3, help="learning rate of those steps")
    p.add_argument("--dataset", default="builtin:reverse", help="the builtin task to train on (builtin:<name>)")
    p.set_defaults(func=_cmd_make_tiny_model)
    cli_render.register(sub)  # async-grpo render CONFIG --backend kubernetes -o DIR
    cli_pipeline.register(sub)  # async-grpo pipeline compile|submit|schedule|run-local
    cli_model.register(sub)  # async-grpo model promote|rollback|show
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "httpx2", "openai", "urllib3", "alembic", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
