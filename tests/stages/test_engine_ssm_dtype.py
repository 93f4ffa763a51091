"""SGLang's ``--mamba-ssm-dtype``, resolved as SGLang 0.5.23's ``mamba2_state_dtype``
(``srt/configs/mamba_utils.py``): the flag, else ``SGLANG_MAMBA_SSM_DTYPE``, else the config's
``mamba_ssm_dtype`` (a vision-language model's ``text_config``'s), else float32. What the
states then answer: ``test_engine_linear_attention.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import structlog
import torch
from structlog.testing import capture_logs

from stages.engine.server import parse_args
from stages.engine.ssm_dtype import ENV, resolve

LOG = structlog.get_logger()


def test_the_flag_then_the_environment_then_the_config_then_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    plain = SimpleNamespace()
    config = SimpleNamespace(mamba_ssm_dtype="float16")
    vision = SimpleNamespace(mamba_ssm_dtype="float32", text_config=config)
    assert resolve(None, plain, LOG) == (torch.float32, "default")
    assert resolve(None, config, LOG) == (torch.float16, "config")
    assert resolve(None, vision, LOG) == (torch.float16, "config")  # the text model's
    assert resolve("bfloat16", config, LOG) == (torch.bfloat16, "flag")
    monkeypatch.setenv(ENV, "bfloat16")
    assert resolve(None, config, LOG) == (torch.bfloat16, "env")
    assert resolve("float32", config, LOG) == (torch.float32, "flag")  # it sets the variable


def test_a_value_that_is_no_dtype_is_passed_over_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "fp8")
    with capture_logs() as logs:
        assert resolve(None, SimpleNamespace(mamba_ssm_dtype="float16"), LOG) == (
            torch.float16,
            "config",
        )
        monkeypatch.delenv(ENV)
        assert resolve(None, SimpleNamespace(mamba_ssm_dtype="half"), LOG) == (
            torch.float32,
            "default",
        )
    said = [(e["event"], e["source"], e["value"]) for e in logs]
    assert said == [
        ("mamba_ssm_dtype_invalid", ENV, "fp8"),
        ("mamba_ssm_dtype_invalid", "config", "half"),
    ]


def test_the_command_line_takes_sglangs_three_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--model", "m", "--mamba-ssm-dtype", "bfloat16"]).mamba_ssm_dtype == (
        "bfloat16"
    )
    assert parse_args(["--model", "m"]).mamba_ssm_dtype is None
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "m", "--mamba-ssm-dtype", "float64"])
    assert exit_.value.code == 2
    assert "--mamba-ssm-dtype: invalid choice: 'float64'" in capsys.readouterr().err
