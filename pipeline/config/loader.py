"""Load a pipeline file and validate all of it before anything runs.

``load_pipeline`` reads the YAML (keeping each key's line), applies command-line overrides,
builds the typed sections, finds each stage's class through ``resolve`` (the plugin registry's
lookup), builds each stage's options into the class's ``Config`` and checks the wiring between
ports and what stages' options must agree on (``pipeline.config.checks``: batch splits over
ranks, group sizes, devices). Path-valued fields are resolved as they are built
(``pipeline.config.paths``): relative to the config file's folder when the file wrote them,
to the working directory when an override did. Given a host ``inventory`` it also places every
replica and launched engine on it (``pipeline.placement``): a ``resources`` request the host
cannot meet is a problem like any other. Every problem found on the way is collected; one
ConfigError reports them all, in file order. It starts nothing and imports no plugin itself.

``LoadedPipeline.resolved()`` is the whole config with every default filled in, as plain data:
``dump_yaml(loaded.resolved())`` is what a run directory keeps as ``config.yaml``, and loading
that file again gives the same config.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import typed
from pipeline.config.checks import pipeline_issues
from pipeline.config.errors import ConfigError, ConfigIssue
from pipeline.config.paths import PathResolver
from pipeline.config.schema import (
    STAGE_KEYS,
    PipelineConfig,
    RunSection,
    StageSection,
    TransportSection,
)
from pipeline.config.wiring import check_wiring
from pipeline.config.yaml_source import Locations, apply_overrides, join_path, load_yaml
from pipeline.stage import stage_config_class
from pipeline.tracking.backends import config_issues as tracker_issues
from transport.address import is_loopback

if TYPE_CHECKING:
    from pipeline.placement import Inventory, Plan

__all__ = ["SECTIONS", "LoadedPipeline", "load_pipeline"]

SECTIONS = ("run", "transport", "stages")
_STAGE_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass
class LoadedPipeline:
    """A validated pipeline: its config, the class of every stage, and the file it came from.

    ``placement`` is the plan on the inventory it was loaded with (None when loaded without).
    """

    config: PipelineConfig
    stage_classes: dict[str, type]
    source: Path
    placement: Plan | None = None

    def resolved(self) -> dict[str, Any]:
        """The whole config as plain data, every default filled in, stage options inline."""
        stages = {}
        for name, section in self.config.stages.items():
            stages[name] = {
                **typed.to_plain(section, skip=("options",)),
                **typed.to_plain(section.options),
            }
        return {
            "run": typed.to_plain(self.config.run),
            "transport": typed.to_plain(self.config.transport),
            "stages": stages,
        }


def load_pipeline(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    resolve: Callable[[str], type],
    inventory: Inventory | None = None,
) -> LoadedPipeline:
    """Load, override and validate the pipeline file at ``path``.

    ``overrides`` are ``dotted.key=VALUE`` strings applied on top of the file. ``resolve`` maps a
    stage's ``use`` to its class; whatever it raises is reported as a problem with that stage.
    ``inventory``: the host to place the stages on (``pipeline.placement.host_inventory()``);
    without it only the host-independent ``resources`` checks run. Raises ConfigError listing
    every problem found.
    """
    from pipeline.placement import plan  # it imports pipeline.config: not at module level

    source = Path(path)
    data, locations, issues = load_yaml(source)
    issues.extend(apply_overrides(data, locations, overrides))
    paths = PathResolver(source, locations)

    for key in data:
        if key not in SECTIONS:
            hint = typed.did_you_mean(key, SECTIONS) or f"; the sections are {', '.join(SECTIONS)}"
            issues.append(
                ConfigIssue(key, f"unknown top-level section {key!r}{hint}", locations.at(key))
            )
    run = _section(RunSection, data, "run", locations, issues, paths)
    transport = _section(TransportSection, data, "transport", locations, issues, paths)
    names, stages, classes, inputs_known = _stages(data, locations, issues, resolve, paths)
    check_wiring(names, stages, classes, inputs_known, locations, issues)
    if run is not None and transport is not None:
        issues.extend(_timing_issues(run, transport, locations))
        issues.extend(_security_issues(run, transport, locations))
    if run is not None and run.launcher == "ray":
        inventory = None  # this host is not where replicas run: Ray places them (cluster.py)
    if run is not None:
        issues.extend(pipeline_issues(run, stages, classes, locations, inventory))
        issues.extend(tracker_issues(run, locations.at))
    placement, found = plan(stages, inventory, locations.at)
    issues.extend(found)

    if issues:
        raise ConfigError(_in_order(issues, str(source), overrides), str(source))
    assert run is not None and transport is not None  # else issues were reported
    return LoadedPipeline(PipelineConfig(run, transport, stages), classes, source, placement)


def _timing_issues(
    run: RunSection, transport: TransportSection, locations: Locations
) -> list[ConfigIssue]:
    """Timeouts must leave room for several heartbeats, or live peers would be taken as gone."""
    found = []
    for path, value in (
        ("run.heartbeat_timeout_s", run.heartbeat_timeout_s),
        ("transport.peer_timeout_s", transport.peer_timeout_s),
    ):
        if value <= 2 * run.heartbeat_s:
            found.append(
                ConfigIssue(
                    path,
                    f"must be more than twice run.heartbeat_s ({run.heartbeat_s}), got {value}: "
                    "raise it or lower run.heartbeat_s",
                    locations.at(path),
                )
            )
    return found


def _security_issues(
    run: RunSection, transport: TransportSection, locations: Locations
) -> list[ConfigIssue]:
    """Sockets reachable from other hosts need CURVE, or an explicit ``transport.insecure``."""
    if transport.curve is not False or transport.insecure:
        return []
    if run.launcher == "ray":
        why = "run.launcher: ray binds every inbox and the control bus on its node's IP"
    elif transport.scheme == "tcp" and not is_loopback(f"tcp://{transport.host}:1"):
        why = f"transport.host {transport.host!r} is reachable from other hosts"
    else:
        return []
    message = (
        f"{why}, and transport.curve: false leaves them open to anyone who reaches the port: "
        "remove it (CURVE is on by default there), or set transport.insecure: true on a "
        "network you trust"
    )
    return [ConfigIssue("transport.curve", message, locations.at("transport.curve"))]


def _section(
    cls: type,
    data: dict[str, Any],
    name: str,
    locations: Locations,
    issues: list[ConfigIssue],
    paths: typed.PathHook,
) -> Any:
    # An absent section, or one left empty (all its keys commented out), means all defaults.
    raw = data[name] if name in data and data[name] is not None else {}
    return typed.build(cls, raw, name, locations, issues, paths=paths, checks=True)


def _stages(
    data: dict[str, Any],
    locations: Locations,
    issues: list[ConfigIssue],
    resolve: Callable[[str], type],
    paths: typed.PathHook,
) -> tuple[list[str], dict[str, StageSection], dict[str, type], set[str]]:
    """Stage names, each buildable stage's section (options in), class, valid-inputs names."""

    def fail(path: str, message: str) -> None:
        issues.append(ConfigIssue(path, message, locations.at(path)))

    raw = data["stages"] if "stages" in data else None
    if not isinstance(raw, Mapping) or not raw:
        if raw is None or isinstance(raw, Mapping):
            fail(
                "stages",
                "no stages: add at least one under `stages:`, as "
                "NAME: {use: PLUGIN, inputs: {PORT: STAGE.PORT}}",
            )
        else:
            fail(
                "stages", f"expected a mapping of stage name -> stage entry, got {typed.show(raw)}"
            )
        return [], {}, {}, set()

    sections: dict[str, StageSection] = {}
    classes: dict[str, type] = {}
    inputs_known: set[str] = set()
    for name, entry in raw.items():
        path = join_path("stages", name)
        if not _STAGE_NAME.fullmatch(name):
            fail(
                path,
                f"stage name {name!r} must match [a-z][a-z0-9_]* (a lowercase letter, "
                "then lowercase letters, digits or underscores)",
            )
        if not isinstance(entry, Mapping):
            fail(
                path,
                f"expected a stage entry (a mapping with at least `use: PLUGIN`), "
                f"got {typed.show(entry)}",
            )
            continue
        runtime = {key: value for key, value in entry.items() if key in STAGE_KEYS}
        options = {key: value for key, value in entry.items() if key not in STAGE_KEYS}
        before = len(issues)
        section = typed.build(
            StageSection,
            runtime,
            path,
            locations,
            issues,
            skip=("options",),
            paths=paths,
            checks=True,
        )
        inputs_path = join_path(path, "inputs")
        if section is not None:
            sections[name] = section
            if not any(
                i.path == inputs_path or i.path.startswith((inputs_path + ".", inputs_path + "["))
                for i in issues[before:]
            ):
                inputs_known.add(name)
        cls = _resolve(entry.get("use"), join_path(path, "use"), resolve, fail)
        if cls is None:
            continue
        classes[name] = cls
        config = _build_options(cls, options, path, locations, issues, fail, paths)
        if section is not None:
            section.options = config
    return list(raw), sections, classes, inputs_known


def _resolve(
    use: Any, path: str, resolve: Callable[[str], type], fail: Callable[[str, str], None]
) -> type | None:
    if not isinstance(use, str) or not use:
        return None  # reported by the StageSection build
    try:
        cls = resolve(use)
    except Exception as exc:  # plugin lookup and import can raise anything: report it
        if isinstance(exc, LookupError):
            message = str(exc.args[0]) if exc.args else f"no stage named {use!r}"
        else:
            message = f"cannot load {use!r}: {type(exc).__name__}: {exc}"
        fail(path, message)
        return None
    if not isinstance(cls, type):
        fail(path, f"{use!r} resolved to {cls!r}, which is not a stage class")
        return None
    return cls


def _build_options(
    cls: type,
    options: dict[str, Any],
    path: str,
    locations: Locations,
    issues: list[ConfigIssue],
    fail: Callable[[str, str], None],
    paths: typed.PathHook,
) -> Any:
    use_path = join_path(path, "use")
    try:
        config_cls = stage_config_class(cls)
    except TypeError as exc:
        fail(use_path, str(exc))
        return None
    clashes = [f.name for f in dataclasses.fields(config_cls) if f.name in STAGE_KEYS]
    if clashes:
        fail(
            use_path,
            f"{cls.__qualname__}.Config has option(s) {', '.join(clashes)} named like "
            f"runtime keys ({', '.join(STAGE_KEYS)}): the plugin must rename them",
        )
        return None
    return typed.build(
        config_cls,
        options,
        path,
        locations,
        issues,
        also_known=STAGE_KEYS,
        paths=paths,
        checks=True,
    )


def _in_order(issues: list[ConfigIssue], file: str, overrides: Sequence[str]) -> list[ConfigIssue]:
    """File issues by line, then override issues by override, then the rest."""
    position = {f"override {text!r}": i for i, text in enumerate(overrides)}

    def key(issue: ConfigIssue) -> tuple[int, ...]:
        if issue.where == file:
            return (0, 0, 0)
        if issue.where.startswith(file + ":"):
            numbers = [int(n) for n in issue.where[len(file) + 1 :].split(":") if n.isdigit()]
            return (0, *numbers, 0) if len(numbers) == 1 else (0, *numbers)
        if issue.where in position:
            return (1, position[issue.where])
        return (2,)

    return sorted(issues, key=key)
