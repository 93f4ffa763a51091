"""`inflight run` and `inflight validate` take options and overrides in any order."""

from __future__ import annotations

import pytest

from pipeline.cli import _parse, _parser
from tests.pipeline.runs import REPO, run_inflight


def parse(*argv: str):
    return _parse(_parser(), list(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ("run", "c.yaml", "a=1", "--run-dir", "D", "b=2", "-q"),
        ("run", "--run-dir", "D", "c.yaml", "a=1", "-q", "b=2"),
        ("run", "-q", "c.yaml", "a=1", "b=2", "--run-dir=D"),
    ],
)
def test_run_takes_options_between_overrides(argv: tuple[str, ...]) -> None:
    args = parse(*argv)
    assert (args.command, args.config, args.overrides) == ("run", "c.yaml", ["a=1", "b=2"])
    assert args.run_dir == "D" and args.quiet is True and args.resume is None


def test_validate_takes_options_between_overrides() -> None:
    args = parse("validate", "c.yaml", "a=1", "b+={x: 1}", "~c")
    assert (args.command, args.config, args.overrides) == (
        "validate",
        "c.yaml",
        ["a=1", "b+={x: 1}", "~c"],
    )


def test_other_commands_parse_as_before() -> None:
    assert parse("stages").command == "stages"
    with pytest.raises(SystemExit) as exc:
        parse("run", "c.yaml", "--nope")
    assert exc.value.code == 2


@pytest.mark.timeout(60)
def test_validate_from_the_command_line() -> None:
    result = run_inflight(
        "validate",
        str(REPO / "configs" / "example.yaml"),
        "stages.power.replicas=3",
        "stages.numbers.count=4",
        timeout=50,
    )
    assert result.returncode == 0, result.stderr
    assert "power(3)" in result.stdout


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_run_with_options_between_overrides(tmp_path) -> None:
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run",
        "configs/example.yaml",
        "stages.numbers.count=20",
        "--run-dir",
        str(run_dir),
        "stages.numbers.dim=4",
        "-q",
        "stages.power.replicas=1",
        timeout=80,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    kept = (run_dir / "config.yaml").read_text()
    assert "count: 20" in kept and "dim: 4" in kept
    assert "replicas: 1" in kept.split("power:")[1].split("summary:")[0]
