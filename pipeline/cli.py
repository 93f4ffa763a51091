"""The ``inflight`` command.

    inflight run CONFIG [KEY=VALUE ...] [--run-dir DIR] [--console status|events] [-q]
                                                          run a pipeline to its end
    inflight validate CONFIG [KEY=VALUE ...]              check a pipeline file, run nothing
    inflight logs RUN_DIR [-f] [--stage S] [--level L] [--event E] [--json|--csv]
    inflight plot RUN_DIR [--out FILE.png]                reward, accuracy, lag, samples/s
    inflight stages                                       list registered plugins
    inflight engine --model-path DIR|ORG/NAME [--port N] [...]   the built-in engine server

``validate`` and ``run`` check the config against this host (``pipeline.placement``): cores and
GPUs a stage asks for must exist; ``validate`` prints where each replica and engine will run.
Both take their options and ``KEY=VALUE`` overrides in any order (``KEY+=VALUE`` appends to a
list, ``a.b.0.c=V`` indexes one: ``pipeline.config.yaml_source.apply_overrides``).

Exit codes: 0 success; 1 the run failed; 2 bad usage or an invalid config (every problem is
printed, never a traceback); 130 interrupted (143 on SIGTERM). Dotted plugin paths
(``my_module:MyStage``) are imported from the current directory as well as from installed
packages, as ``python -m`` would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from pipeline.config import ConfigError, LoadedPipeline, load_pipeline
from pipeline.log_view import add_logs_arguments, run_logs
from pipeline.placement import host_inventory
from pipeline.processes import exit_now
from pipeline.registry import list_plugins, resolve

__all__ = ["main"]

EXIT_INVALID = 2


def _resolve_stage(name: str) -> type:
    return resolve("stage", name)


def _load(args: argparse.Namespace) -> LoadedPipeline | None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return load_pipeline(
            args.config, args.overrides, resolve=_resolve_stage, inventory=host_inventory()
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _cmd_validate(args: argparse.Namespace) -> int:
    loaded = _load(args)
    if loaded is None:
        return EXIT_INVALID
    stages = ", ".join(f"{n}({s.replicas})" for n, s in loaded.config.stages.items())
    print(f"{args.config}: valid ({len(loaded.config.stages)} stages: {stages})")
    if loaded.placement is not None:
        print(f"placement on this host: {loaded.placement.inventory.describe()}")
        for line in loaded.placement.lines():
            print(f"  {line}")
        from pipeline.launchers.shared import shared_stages

        shared, _ = shared_stages(loaded)
        if shared:
            names = ", ".join(n for n in loaded.config.stages if n in shared)
            print(f"one shared process (run.share_process): {names}")
    if loaded.config.run.launcher == "ray":
        return _print_ray_plan(loaded)
    return 0


def _print_ray_plan(loaded: LoadedPipeline) -> int:
    from pipeline import cluster  # joins the cluster only to read its nodes

    asks, problems = cluster.asks(loaded.config)
    try:
        nodes, which = cluster.nodes_of(loaded.config.run.ray.address)
    except cluster.ClusterUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if nodes is None:
        print(f"Ray plan: not checked: {which}")
    else:
        lines, unplaceable = cluster.plan(asks, nodes)
        problems += unplaceable
        if lines:
            print(f"Ray plan on {which}:")
            for line in lines:
                print(f"  {line}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return EXIT_INVALID if problems else 0


def _cmd_run(args: argparse.Namespace) -> int:
    from pipeline.supervisor import Supervisor, make_run_dir  # the runtime, only when running

    loaded = _load(args)
    if loaded is None:
        return EXIT_INVALID
    if args.resume and args.run_dir:
        print("error: give either --resume RUN_DIR or --run-dir, not both", file=sys.stderr)
        return EXIT_INVALID
    try:
        run_dir = make_run_dir(loaded, args.resume or args.run_dir, resume=bool(args.resume))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(f"run directory: {run_dir}", flush=True)
    supervisor = Supervisor(loaded, run_dir, console=None if args.quiet else args.console)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(supervisor.run())
    return uvloop.run(supervisor.run())


def _cmd_stages(args: argparse.Namespace) -> int:
    plugins = list_plugins()
    if not plugins:
        print("no plugins registered")
        return 0
    rows = [(p.kind, p.name, p.target, f"(from {p.distribution})") for p in plugins]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)), row[3])
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inflight", description="Asynchronous RL for language models with in-flight updates."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.set_defaults(_commands=sub.choices)  # for _parse: each command's own parser

    run = sub.add_parser("run", help="run a pipeline YAML to its end")
    run.add_argument("config", metavar="CONFIG", help="pipeline YAML file")
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    run.add_argument("--run-dir", help="run directory (default: run.runs_root/NAME-TIMESTAMP)")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue an earlier run in its directory, from its newest checkpoint",
    )
    run.add_argument(
        "--console",
        choices=["status", "events"],
        default="status",
        help="status (default): a live status block (on a terminal; else a line every "
        "run.console_every_s) and the events that matter; events: every event as a line",
    )
    run.add_argument(
        "-q", "--quiet", action="store_true", help="no console view (only the run directory)"
    )
    run.set_defaults(func=_cmd_run)

    validate = sub.add_parser("validate", help="check a pipeline YAML and report every problem")
    validate.add_argument("config", metavar="CONFIG")
    validate.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    validate.set_defaults(func=_cmd_validate)

    logs = sub.add_parser("logs", help="show, filter and follow a run's logs")
    add_logs_arguments(logs)
    logs.set_defaults(func=run_logs)

    from pipeline.plot import add_plot_arguments, run_plot  # imports matplotlib only to draw

    plot = sub.add_parser(
        "plot", help="draw a run's reward, held-out accuracy, lag and samples/s (PNG)"
    )
    add_plot_arguments(plot)
    plot.set_defaults(func=run_plot)

    # listed for --help; `main` hands its arguments to the engine's own parser
    sub.add_parser(
        "engine", help="serve a Hugging Face model over the SGLang HTTP API (built-in engine)"
    )

    stages = sub.add_parser("stages", help="list registered stages, rewards and engines")
    stages.set_defaults(func=_cmd_stages)
    return parser


# Commands whose KEY=VALUE overrides and options may come in any order.
_INTERMIXED = ("run", "validate")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, except that ``run`` and ``validate`` take their options before,
    between or after the overrides (``inflight run C K=V --run-dir D K2=V2 -q``)."""
    if argv[:1] and argv[0] in _INTERMIXED:
        args = parser.get_default("_commands")[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:  # the engine server parses its own options (--model, --port...)
        from stages.engine.server import main as engine_main  # torch + transformers: only here

        code = engine_main(argv[1:])
        if __name__ == "__main__":  # a child of a generator: closed and flushed, end it now
            exit_now(code)
        return code
    args = _parse(_parser(), argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
