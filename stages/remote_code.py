"""Whether this process may run a model folder's own code (its ``auto_map``: the config,
model and tokenizer classes some models ship, MiniCPM's, InternLM's...).

``run.trust_remote_code: true`` sets ``INFLIGHT_TRUST_REMOTE_CODE=1`` for every process of the
run; the stages' transformers loads (the learner's model and reference model, the feeder's,
scorer's and rollouts' tokenizers) then pass ``trust_remote_code=True``, and the engines a
generator launches get SGLang's ``--trust-remote-code``. Without it transformers is told
``False`` (never left to ask on a terminal), so such a folder fails at once with its reason.
"""

from __future__ import annotations

import os

from pipeline.config.schema import TRUST_REMOTE_CODE_ENV

__all__ = ["TRUST_REMOTE_CODE_ENV", "remote_code_trusted"]


def remote_code_trusted() -> bool:
    """Whether the run trusts model folders' own code (``INFLIGHT_TRUST_REMOTE_CODE=1``)."""
    return os.environ.get(TRUST_REMOTE_CODE_ENV, "") == "1"
