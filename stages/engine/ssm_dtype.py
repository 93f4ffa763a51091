"""The dtype a linear-attention layer keeps its recurrent state in between passes: SGLang's
``--mamba-ssm-dtype`` (``configs/mamba_utils.py``, ``mamba2_state_dtype``).

SGLang resolves it in this order: the flag (which sets ``SGLANG_MAMBA_SSM_DTYPE``), else that
environment variable, else the model config's ``mamba_ssm_dtype`` (its ``text_config``'s when it
has one), else float32. A value in the environment or the config that is none of ``float32``,
``bfloat16`` and ``float16`` is passed over with a warning, as SGLang's is. A pass computes the
state in float32 whatever this is (transformers' layers do); the engine's slots and its prefix
cache keep it in this dtype, so it is rounded to it after every pass, as in SGLang's Mamba pool.
The convolution's state stays in the dtype the pass makes it in.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from stages.engine.loader import DTYPES  # SGLang's three names, as --dtype takes them

__all__ = ["DTYPES", "resolve"]

ENV = "SGLANG_MAMBA_SSM_DTYPE"


def resolve(flag: str | None, config: Any, log: Any) -> tuple[torch.dtype, str]:
    """The recurrent states' dtype and where it came from (``flag``, ``env``, ``config`` or
    ``default``); ``flag`` is the command line's ``--mamba-ssm-dtype`` (None: not given)."""
    if flag is not None:
        if flag not in DTYPES:  # (the command line's choices refuse it before)
            raise ValueError(f"--mamba-ssm-dtype must be one of {sorted(DTYPES)}, got {flag!r}")
        return DTYPES[flag], "flag"
    dtype, source = torch.float32, "default"
    text = getattr(config, "text_config", None)
    given = getattr(text if hasattr(text, "mamba_ssm_dtype") else config, "mamba_ssm_dtype", None)
    if given is not None:
        if given in DTYPES:
            dtype, source = DTYPES[given], "config"
        else:
            log.warning("mamba_ssm_dtype_invalid", source="config", value=given, kept="float32")
    env = os.environ.get(ENV)
    if env is not None:
        if env in DTYPES:
            dtype, source = DTYPES[env], "env"
        else:
            log.warning("mamba_ssm_dtype_invalid", source=ENV, value=env, kept=str(dtype))
    return dtype, source
