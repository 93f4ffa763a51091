"""Loading whole pipeline files: sections, stage options, wiring, overrides, round trip."""

from __future__ import annotations

import difflib
import pickle
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from pipeline.config import (
    ConfigError,
    ConfigIssue,
    LoadedPipeline,
    StageSection,
    dump_yaml,
    load_pipeline,
)
from pipeline.config.schema import Resources
from pipeline.stage import NoConfig, Port
from transport.message import Schema

NUMBER = Schema("number", 1, {"value": "int"})
NUMBER_V2 = Schema("number", 2, {"value": "int"})
TEXT = Schema("text", 1, {"text": "str"})


class Numbers:
    @dataclass
    class Config:
        count: int = field(default=10, metadata={"min": 1})
        start: int = 0

    outputs = {"out": Port(NUMBER)}


class Power:
    @dataclass
    class Config:
        exponent: int = 2
        mode: Literal["fast", "exact"] = "exact"

    inputs = {"numbers": Port(NUMBER)}
    outputs = {"out": Port(NUMBER)}


class Summary:  # no Config: takes no options
    inputs = {"values": Port(NUMBER), "extra": Port(NUMBER, optional=True)}


class Model:
    @dataclass
    class Config:
        model: str
        lr: float = 1e-3

    outputs = {"log": Port(TEXT, optional=True)}


class NumbersV2:
    outputs = {"out": Port(NUMBER_V2, TEXT)}


class Broken:
    Config = dict  # not a dataclass


class BadPorts:
    outputs = {"out": "number"}


class Clashing:
    @dataclass
    class Config:
        replicas: int = 1


STAGES = {
    "numbers": Numbers,
    "power": Power,
    "summary": Summary,
    "model": Model,
    "numbers_v2": NumbersV2,
    "broken": Broken,
    "clashing": Clashing,
    "bad_ports": BadPorts,
}


def resolve(name: str) -> type:
    if name == "explodes":
        raise ZeroDivisionError("division by zero")
    if name not in STAGES:
        close = difflib.get_close_matches(name, STAGES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise LookupError(f"no stage named {name!r}{hint}")
    return STAGES[name]


GOOD = """\
    run:
      name: demo
      metrics_every_s: 5
    transport:
      inbox: 16
    stages:
      numbers:
        use: numbers
        count: 5
      square:
        use: power
        replicas: 2
        restart: {policy: never}
        inputs: {numbers: numbers.out}
        exponent: 3
      summary:
        use: summary
        inputs:
          values: [square.out]
        env: {DEBUG: "1"}
"""


def write(tmp_path: Path, text: str, name: str = "pipeline.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_error(path: Path, overrides: tuple[str, ...] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        load_pipeline(path, overrides, resolve=resolve)
    return exc.value


def at(err: ConfigError, path: str) -> ConfigIssue:
    found = [i for i in err.issues if i.path == path]
    assert len(found) == 1, f"{path}: {err.issues}"
    return found[0]


def line(issue: ConfigIssue) -> int:
    return int(issue.where.split(":")[1])


# --- valid files -------------------------------------------------------------------------------


def test_valid_file_loads_with_defaults_options_and_classes(tmp_path: Path) -> None:
    loaded = load_pipeline(write(tmp_path, GOOD), resolve=resolve)
    cfg = loaded.config
    assert cfg.run.name == "demo" and cfg.run.metrics_every_s == 5.0 and cfg.run.seed == 0
    assert cfg.transport.inbox == 16 and cfg.transport.scheme == "ipc"
    square = cfg.stages["square"]
    assert square.replicas == 2 and square.restart.policy == "never"
    assert square.restart.max_restarts == 3
    assert square.options == Power.Config(exponent=3)
    assert cfg.stages["numbers"].options == Numbers.Config(count=5)
    assert cfg.stages["summary"].options == NoConfig()
    assert cfg.stages["summary"].inputs == {"values": ["square.out"]}
    assert loaded.stage_classes == {"numbers": Numbers, "square": Power, "summary": Summary}
    assert loaded.source == tmp_path / "pipeline.yaml"


def test_resolved_round_trips_through_yaml(tmp_path: Path) -> None:
    loaded = load_pipeline(write(tmp_path, GOOD), ["stages.numbers.start=7"], resolve=resolve)
    resolved = loaded.resolved()
    assert resolved["stages"]["numbers"]["start"] == 7
    assert resolved["stages"]["square"]["mode"] == "exact"  # option defaults filled in
    assert resolved["stages"]["square"]["restart"]["backoff_s"] == 0.5
    assert resolved["run"]["heartbeat_s"] == 1.0
    assert "options" not in resolved["stages"]["square"]
    again = load_pipeline(write(tmp_path, dump_yaml(resolved), "config.yaml"), resolve=resolve)
    assert again.config == loaded.config
    assert again.resolved() == resolved


def test_empty_sections_mean_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        run:
          # name: commented out
        stages:
          solo: {use: model, model: tiny}
    """,
    )
    loaded = load_pipeline(path, resolve=resolve)
    assert loaded.config.run.name == "inflight"
    assert loaded.config.stages["solo"].options == Model.Config(model="tiny")


def test_overrides_apply_before_validation(tmp_path: Path) -> None:
    loaded = load_pipeline(
        write(tmp_path, GOOD),
        [
            "stages.square.replicas=4",
            "run.name=other",
            "stages.square.mode=fast",
            "stages.summary.inputs={values: square.out, extra: []}",
        ],
        resolve=resolve,
    )
    square = loaded.config.stages["square"]
    assert square.replicas == 4 and square.options.mode == "fast"
    assert loaded.config.run.name == "other"
    assert loaded.config.stages["summary"].inputs == {"values": "square.out", "extra": []}


def test_switching_plugin_by_override_removes_options_with_tilde(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    err = load_error(path, ("stages.square.use=model", "stages.square.model=m"))
    assert at(err, "stages.square.exponent").message.startswith("unknown key 'exponent'")
    loaded = load_pipeline(
        path,
        [
            "stages.square.use=model",
            "stages.square.model=m",
            "~stages.square.exponent",
            "~stages.square.inputs",
            "stages.summary.inputs={values: numbers.out}",
        ],
        resolve=resolve,
    )
    assert loaded.config.stages["square"].options == Model.Config(model="m")


# --- reporting ---------------------------------------------------------------------------------


def test_four_mistakes_give_four_issues_in_file_order(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        run:
          seed: two
        stages:
          numbers:
            use: numbers
            count: 0
          square:
            use: power
            replica: 2
            inputs: {numbers: numbers.out}
          summary:
            use: sumary
            inputs: {values: square.out}
    """,
    )
    err = load_error(path)
    assert [(i.path, line(i)) for i in err.issues] == [
        ("run.seed", 2),
        ("stages.numbers.count", 6),
        ("stages.square.replica", 9),
        ("stages.summary.use", 12),
    ]
    assert at(err, "run.seed").message == "expected an integer, got 'two' (str)"
    assert at(err, "stages.numbers.count").message == "must be at least 1, got 0"
    assert at(err, "stages.square.replica").message == (
        "unknown key 'replica'; did you mean 'replicas'?"
    )
    assert at(err, "stages.summary.use").message == (
        "no stage named 'sumary'; did you mean 'summary'?"
    )
    text = str(err)
    assert text.splitlines()[0] == f"4 problems in {path}:"
    assert f"  {path}:2: run.seed: expected an integer, got 'two' (str)" in text.splitlines()
    assert len(text.splitlines()) == 5


def test_single_issue_prints_as_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "    extra_section: {}\n")
    err = load_error(path)
    assert str(err) == (
        f"{path}:21: extra_section: unknown top-level section "
        "'extra_section'; the sections are run, transport, stages"
    )


def test_config_error_survives_pickling(tmp_path: Path) -> None:
    err = load_error(write(tmp_path, "run: {seed: x}\nstages: {a: {use: model}}\n"))
    again = pickle.loads(pickle.dumps(err))
    assert again.issues == err.issues and str(again) == str(err)


def test_unknown_section_gets_did_you_mean(tmp_path: Path) -> None:
    err = load_error(write(tmp_path, GOOD + "    transprt: {inbox: 2}\n"))
    assert at(err, "transprt").message == (
        "unknown top-level section 'transprt'; did you mean 'transport'?"
    )


def test_file_level_problem_stops_early(tmp_path: Path) -> None:
    err = load_error(write(tmp_path, "- a\n"))
    assert err.issues[0].path == "" and "top level must be a mapping" in err.issues[0].message


def test_yaml_issues_join_the_rest(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "    run: {name: again}\n")
    err = load_error(path, ("run.seed=x",))
    assert "duplicate key 'run' (first at line 1, again at line 21)" in at(err, "run").message
    assert at(err, "run.seed").where == "override 'run.seed=x'"


# --- stages ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ("", "no stages: add at least one under `stages:`"),
        ("stages: {}", "no stages: add at least one under `stages:`"),
        ("stages: [a, b]", "expected a mapping of stage name -> stage entry, got a list"),
    ],
)
def test_stages_must_be_a_non_empty_mapping(tmp_path: Path, stages: str, message: str) -> None:
    err = load_error(write(tmp_path, "run: {name: x}\n" + stages + "\n"))
    assert message in at(err, "stages").message


def test_stage_names_and_entries_are_checked(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        stages:
          Solo-1: {use: model, model: m}
          empty:
          nouse: {replicas: 2}
    """,
    )
    err = load_error(path)
    assert "stage name 'Solo-1' must match [a-z][a-z0-9_]*" in at(err, "stages.Solo-1").message
    assert line(at(err, "stages.Solo-1")) == 2
    assert (
        "expected a stage entry (a mapping with at least `use: PLUGIN`), got null"
        in at(err, "stages.empty").message
    )
    missing = at(err, "stages.nouse.use")
    assert missing.message.startswith("missing required key 'use' (registered plugin name")
    assert line(missing) == 4


def test_resolve_failures_are_issues_at_use(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        stages:
          a: {use: modle, model: m}
          b: {use: explodes}
          c: {use: broken}
          d: {use: clashing}
          e: {use: bad_ports}
    """,
    )
    err = load_error(path)
    assert at(err, "stages.a.use").message == "no stage named 'modle'; did you mean 'model'?"
    assert at(err, "stages.b.use").message == (
        "cannot load 'explodes': ZeroDivisionError: division by zero"
    )
    assert "Broken.Config must be a dataclass" in at(err, "stages.c.use").message
    assert "option(s) replicas named like runtime keys" in at(err, "stages.d.use").message
    assert "BadPorts.outputs must map names to Port" in at(err, "stages.e.use").message
    assert [line(i) for i in err.issues] == [2, 3, 4, 5, 6]


def test_stage_options_are_checked_against_the_config_class(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        stages:
          numbers:
            use: numbers
            cont: 3
            rplicas: 2
            start: [1]
            nothing_like_it: 1
          solo:
            use: model
    """,
    )
    err = load_error(path)
    assert at(err, "stages.numbers.cont").message == "unknown key 'cont'; did you mean 'count'?"
    assert at(err, "stages.numbers.rplicas").message == (
        "unknown key 'rplicas'; did you mean 'replicas'?"
    )  # runtime keys are suggested too
    assert at(err, "stages.numbers.start").message == "expected an integer, got a list [1]"
    assert at(err, "stages.numbers.nothing_like_it").message == (
        "unknown key 'nothing_like_it'; valid keys: count, start, use, replicas, restart, inbox, "
        "inputs, env, resources"
    )
    assert at(err, "stages.solo.model").message == "missing required key 'model'"
    assert line(at(err, "stages.solo.model")) == 8


def test_runtime_keys_are_typed(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        stages:
          solo:
            use: model
            model: m
            replicas: 0
            inbox: lots
            restart: {policy: on_failure}
            env: {DEBUG: 1}
    """,
    )
    err = load_error(path)
    assert [(i.path, line(i)) for i in err.issues] == [
        ("stages.solo.replicas", 5),
        ("stages.solo.inbox", 6),
        ("stages.solo.restart.policy", 7),
        ("stages.solo.env.DEBUG", 8),
    ]
    assert at(err, "stages.solo.restart.policy").message.endswith("did you mean 'on-failure'?")
    assert "quote the value" in at(err, "stages.solo.env.DEBUG").message


def test_override_paths_report_at_the_override(tmp_path: Path) -> None:
    err = load_error(
        write(tmp_path, GOOD),
        ("stages.square.replicas=two", "stages.numbers.count=x", "stages.new.use=powr", "nope"),
    )
    assert [i.where for i in err.issues] == [
        "override 'stages.square.replicas=two'",
        "override 'stages.numbers.count=x'",
        "override 'stages.new.use=powr'",
        "override 'nope'",
    ]
    assert at(err, "stages.square.replicas").message == "expected an integer, got 'two' (str)"
    assert at(err, "stages.new.use").message == "no stage named 'powr'; did you mean 'power'?"


# --- wiring ------------------------------------------------------------------------------------


def wiring_error(tmp_path: Path, stages: str) -> ConfigError:
    return load_error(write(tmp_path, "stages:\n" + textwrap.indent(textwrap.dedent(stages), "  ")))


def test_unknown_input_port_and_sources(tmp_path: Path) -> None:
    err = wiring_error(
        tmp_path,
        """\
        numbers: {use: numbers}
        square:
          use: power
          inputs: {number: numbers.out, numbers: numbres.out}
        summary:
          use: summary
          inputs: {values: [square.outt, square]}
    """,
    )
    assert at(err, "stages.square.inputs.number").message == (
        "stage 'square' (Power) has no input port 'number'; did you mean 'numbers'?"
    )
    assert at(err, "stages.square.inputs.numbers").message == (
        "no stage named 'numbres'; did you mean 'numbers'?"
    )
    assert at(err, "stages.summary.inputs.values[0]").message == (
        "stage 'square' (Power) has no output port 'outt'; did you mean 'out'?"
    )
    assert at(err, "stages.summary.inputs.values[1]").message == (
        "expected 'STAGE.PORT' (an upstream stage and one of its output ports), got 'square'"
    )
    assert [line(i) for i in err.issues] == [5, 5, 8, 8]  # no follow-on "not connected" noise


def test_output_port_feeds_one_input_port(tmp_path: Path) -> None:
    err = wiring_error(
        tmp_path,
        """\
        numbers: {use: numbers}
        square: {use: power, inputs: {numbers: numbers.out}}
        cube: {use: power, inputs: {numbers: numbers.out}}
        summary: {use: summary, inputs: {values: [square.out, cube.out, cube.out]}}
    """,
    )
    fan_out = at(err, "stages.cube.inputs.numbers")
    assert line(fan_out) == 4
    assert fan_out.message.startswith(
        f"output port numbers.out feeds two input ports: square.numbers ({tmp_path}/pipeline.yaml"
        ":3) and cube.numbers; an output port may feed only one input port"
    )
    assert at(err, "stages.summary.inputs.values[2]").message == (
        "cube.out is listed twice for summary.values: remove one"
    )
    assert len(err.issues) == 2


def test_unconnected_ports(tmp_path: Path) -> None:
    err = wiring_error(
        tmp_path,
        """\
        numbers: {use: numbers}
        square: {use: power, inputs: {numbers: numbers.out}}
        summary: {use: summary, inputs: {values: []}}
        solo: {use: model, model: m}
    """,
    )
    assert at(err, "stages.square").message == (
        "output port square.out is not connected: add `inputs: {PORT: square.out}` to the stage "
        "that should receive it"
    )
    assert line(at(err, "stages.square")) == 3
    assert at(err, "stages.summary.inputs").message == (
        "input port summary.values is not connected: add `inputs: {values: STAGE.PORT}` to stage "
        "'summary' (outputs that fit: numbers.out, square.out)"
    )
    assert len(err.issues) == 2  # optional ports (summary.extra, solo.log) may stay unwired


def test_kinds_must_match(tmp_path: Path) -> None:
    err = wiring_error(
        tmp_path,
        """\
        numbers: {use: numbers_v2}
        summary: {use: summary, inputs: {values: numbers.out}}
    """,
    )
    assert [i.path for i in err.issues] == ["stages.summary.inputs.values"]
    assert err.issues[0].message == (
        "numbers.out sends 'number' version 2, but it accepts version 1; and kind 'text' "
        "(version 1), which it does not accept (summary.values accepts 'number' v1)"
    )


def test_stage_classes_without_ports_have_none(tmp_path: Path) -> None:
    err = wiring_error(
        tmp_path,
        """\
        solo: {use: model, model: m, inputs: {x: solo.out}}
    """,
    )
    assert [i.message for i in err.issues] == [
        "stage 'solo' (Model) has no input port 'x'; it has no input ports",
        "stage 'solo' (Model) has no output port 'out'; its output ports: log",
    ]


def test_fan_in_from_several_outputs_is_fine(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        stages:
          a: {use: numbers}
          b: {use: numbers}
          sum: {use: summary, inputs: {values: [a.out, b.out]}}
    """,
    )
    loaded = load_pipeline(path, resolve=resolve)
    assert isinstance(loaded, LoadedPipeline)
    assert isinstance(loaded.config.stages["sum"], StageSection)


def test_timeouts_must_leave_room_for_heartbeats(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "run:\n  heartbeat_s: 1.0\n  heartbeat_timeout_s: 1.5\n"
        "transport:\n  peer_timeout_s: 2.0\n"
        "stages:\n  src: {use: numbers}\n  sink: {use: summary, inputs: {values: src.out}}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_pipeline(path, resolve=resolve)
    found = {(i.path, i.where) for i in err.value.issues}
    assert found == {
        ("run.heartbeat_timeout_s", f"{path}:3"),
        ("transport.peer_timeout_s", f"{path}:5"),
    }


def test_resources_are_a_typed_runtime_key_that_round_trips(tmp_path: Path) -> None:
    overrides = ["stages.square.resources={cpus: 1, gpus: [0, 1]}", "stages.numbers.resources={}"]
    loaded = load_pipeline(write(tmp_path, GOOD), overrides, resolve=resolve)
    resources = loaded.config.stages["square"].resources
    assert (resources.cpus, resources.gpus) == (1, [0, 1])
    assert loaded.config.stages["summary"].resources == Resources()  # asks for nothing
    again = write(tmp_path, dump_yaml(loaded.resolved()), "resolved.yaml")
    assert load_pipeline(again, resolve=resolve).resolved() == loaded.resolved()
    err = load_error(
        write(
            tmp_path,
            GOOD.replace("count: 5", "count: 5\n        resources: {cpu: 2, gpus: true}"),
        )
    )
    assert at(err, "stages.numbers.resources.cpu").message == (
        "unknown key 'cpu'; did you mean 'cpus'?"
    )
    gpus = at(err, "stages.numbers.resources.gpus")
    assert "got true (bool)" in gpus.message and line(gpus) == 10


@pytest.mark.parametrize(
    "overrides",
    [
        ("run.launcher=ray", "transport.curve=false"),
        ("transport.scheme=tcp", "transport.host=10.0.0.5", "transport.curve=false"),
    ],
)
def test_sockets_off_loopback_without_curve_need_insecure_said_out_loud(tmp_path, overrides):
    path = write(tmp_path, GOOD)
    err = load_error(path, overrides)
    issue = at(err, "transport.curve")
    assert "open to anyone who reaches the port" in issue.message
    assert "transport.insecure: true" in issue.message
    load_pipeline(path, [*overrides, "transport.insecure=true"], resolve=resolve)
    load_pipeline(path, [o for o in overrides if "curve" not in o], resolve=resolve)  # auto: on
    load_pipeline(path, ["transport.curve=false"], resolve=resolve)  # ipc on one host: fine
