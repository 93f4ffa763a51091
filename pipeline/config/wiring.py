"""Check the wiring between stages: each ``inputs`` edge, fan-out, kinds, dangling ports.

A stage's ``inputs`` maps one of its input ports to upstream ``STAGE.PORT`` sources (fan-in is
fine). The checks: the input port and each source exist (with did-you-mean); an output port
feeds at most one input port; every kind an output port sends is accepted, at the same schema
version, by the input port it feeds; every non-optional port is connected. Port declarations are
the stage class's ``inputs``/``outputs`` attributes (absent means none). Only reports problems.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from pipeline.config.errors import ConfigIssue
from pipeline.config.schema import StageSection
from pipeline.config.typed import did_you_mean
from pipeline.config.yaml_source import Locations, join_path
from pipeline.stage import Port, stage_ports

__all__ = ["check_wiring"]

_Fail = Callable[[str, str], None]


@dataclass(frozen=True)
class _Edge:
    producer: str
    output: str
    consumer: str
    input: str
    path: str  # key path of the source in the consumer's `inputs`


def _listing(what: str, names: Collection[str]) -> str:
    return f"; its {what}: {', '.join(names)}" if names else f"; it has no {what}"


def check_wiring(
    names: Collection[str],
    sections: Mapping[str, StageSection],
    classes: Mapping[str, type],
    inputs_known: Collection[str],
    locations: Locations,
    issues: list[ConfigIssue],
) -> None:
    """Append every wiring problem to ``issues``.

    ``names`` are all stage names in the file; ``sections`` and ``classes`` those that could be
    built and resolved; ``inputs_known`` the stages whose ``inputs`` were valid. Checks that
    need the whole graph (dangling output ports) run only when every stage's wiring is known.
    """

    def fail(path: str, message: str) -> None:
        issues.append(ConfigIssue(path, message, locations.at(path)))

    ins: dict[str, Mapping[str, Port]] = {}
    outs: dict[str, Mapping[str, Port]] = {}
    for name, cls in classes.items():
        try:
            ins[name], outs[name] = stage_ports(cls)
        except TypeError as exc:  # a plugin's malformed port declarations
            fail(join_path(join_path("stages", name), "use"), str(exc))
            ins[name], outs[name] = {}, {}

    edges: list[_Edge] = []
    sources_ok = True
    for consumer, section in sections.items():
        inputs_path = join_path(join_path("stages", consumer), "inputs")
        for port, sources in section.inputs.items():
            port_path = join_path(inputs_path, port)
            if consumer in ins and port not in ins[consumer]:
                cls_name = classes[consumer].__qualname__
                fail(
                    port_path,
                    f"stage {consumer!r} ({cls_name}) has no input port {port!r}"
                    + (did_you_mean(port, ins[consumer]) or _listing("input ports", ins[consumer])),
                )
                sources_ok = False
            listed = (
                [(sources, port_path)]
                if isinstance(sources, str)
                else [(source, f"{port_path}[{i}]") for i, source in enumerate(sources)]
            )
            for source, path in listed:
                edge = _edge(source, consumer, port, path, names, classes, outs, fail)
                if edge is None:
                    sources_ok = False
                else:
                    edges.append(edge)

    _check_fan_out(edges, locations, fail)
    for edge in edges:
        if edge.consumer in ins and edge.input in ins[edge.consumer] and edge.producer in outs:
            _check_kinds(
                edge, outs[edge.producer][edge.output], ins[edge.consumer][edge.input], fail
            )
    for consumer in sections:
        if consumer in ins and consumer in inputs_known:
            _check_inputs_wired(consumer, sections[consumer], ins[consumer], outs, fail)
    if sources_ok and set(names) <= set(inputs_known) and set(names) <= set(classes):
        wired = {(edge.producer, edge.output) for edge in edges}
        for producer in names:
            for port, declared in outs[producer].items():
                if not declared.optional and (producer, port) not in wired:
                    fail(
                        join_path("stages", producer),
                        f"output port {producer}.{port} is not connected: add `inputs: "
                        f"{{PORT: {producer}.{port}}}` to the stage that should receive it",
                    )


def _edge(
    source: str,
    consumer: str,
    port: str,
    path: str,
    names: Collection[str],
    classes: Mapping[str, type],
    outs: Mapping[str, Mapping[str, Port]],
    fail: _Fail,
) -> _Edge | None:
    producer, dot, output = source.partition(".")
    if not dot or not producer or not output or "." in output:
        fail(
            path,
            f"expected 'STAGE.PORT' (an upstream stage and one of its output ports), "
            f"got {source!r}",
        )
        return None
    if producer not in names:
        fail(
            path,
            f"no stage named {producer!r}"
            + (did_you_mean(producer, names) or f"; the stages: {', '.join(names)}"),
        )
        return None
    if producer in outs and output not in outs[producer]:
        cls_name = classes[producer].__qualname__
        fail(
            path,
            f"stage {producer!r} ({cls_name}) has no output port {output!r}"
            + (did_you_mean(output, outs[producer]) or _listing("output ports", outs[producer])),
        )
        return None
    return _Edge(producer, output, consumer, port, path)


def _check_fan_out(edges: list[_Edge], locations: Locations, fail: _Fail) -> None:
    first: dict[tuple[str, str], _Edge] = {}
    for edge in edges:
        key = (edge.producer, edge.output)
        if key not in first:
            first[key] = edge
            continue
        taken = first[key]
        if (taken.consumer, taken.input) == (edge.consumer, edge.input):
            fail(
                edge.path,
                f"{edge.producer}.{edge.output} is listed twice for "
                f"{edge.consumer}.{edge.input}: remove one",
            )
            continue
        fail(
            edge.path,
            f"output port {edge.producer}.{edge.output} feeds two input ports: "
            f"{taken.consumer}.{taken.input} ({locations.at(taken.path)}) and "
            f"{edge.consumer}.{edge.input}; an output port may feed only one input "
            "port (fan-in is fine: one input port may list several sources)",
        )


def _check_kinds(edge: _Edge, output: Port, target: Port, fail: _Fail) -> None:
    accepted = target.kinds
    problems = []
    for schema in output.schemas:
        if schema.kind in output.if_accepted:
            continue  # sent only where accepted
        if schema.kind not in accepted:
            problems.append(
                f"kind {schema.kind!r} (version {schema.version}), which it does not accept"
            )
        elif accepted[schema.kind] != schema.version:
            problems.append(
                f"{schema.kind!r} version {schema.version}, but it accepts version "
                f"{accepted[schema.kind]}"
            )
    if problems:
        accepts = ", ".join(f"{kind!r} v{version}" for kind, version in accepted.items())
        fail(
            edge.path,
            f"{edge.producer}.{edge.output} sends {'; and '.join(problems)} "
            f"({edge.consumer}.{edge.input} accepts {accepts})",
        )


def _accepts(target: Port, output: Port) -> bool:
    return all(
        target.kinds.get(s.kind) == s.version
        for s in output.schemas
        if s.kind not in output.if_accepted
    )


def _check_inputs_wired(
    consumer: str,
    section: StageSection,
    declared: Mapping[str, Port],
    outs: Mapping[str, Mapping[str, Port]],
    fail: _Fail,
) -> None:
    for port, spec in declared.items():
        if spec.optional or section.inputs.get(port):
            continue
        fits = [
            f"{producer}.{name}"
            for producer, ports in outs.items()
            for name, output in ports.items()
            if producer != consumer and _accepts(spec, output)
        ]
        hint = f" (outputs that fit: {', '.join(fits[:5])})" if fits else ""
        fail(
            join_path(join_path("stages", consumer), "inputs"),
            f"input port {consumer}.{port} is not connected: add `inputs: {{{port}: "
            f"STAGE.PORT}}` to stage {consumer!r}{hint}",
        )
