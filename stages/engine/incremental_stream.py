"""SGLang's ``--incremental-streaming-output`` on ``/generate`` streams: each chunk holds what
is new since the sample's last one, not its whole output so far.

As SGLang 0.5.23's ``TokenizerManager._handle_batch_output`` builds such a chunk: ``text`` and
``output_ids`` are the new text and ids (its last chunk's too), and of ``meta_info`` the
per-token lists ``_INCREMENTAL_STREAMING_META_INFO_KEYS`` names (the output's log-probs, top
log-probs, asked tokens' log-probs and sampling masks) start at the first token not sent yet
(``_slice_streaming_output_meta_info``); the rest (``completion_tokens``, the lengths, the
prompt's log-probs, hidden states) stays whole. A sample aborted while it waited keeps its last
id alone and its whole text (``_handle_abort_req``). Chunks that piled up while the client read
are one chunk with all that is new in them, as SGLang's ``_coalesce_streaming_chunks`` joins
them. The ``/v1`` streams, deltas either way, are not changed (SGLang's are the same).
"""

from __future__ import annotations

from typing import Any

from stages.engine.aborts import ABORTED_WAITING

__all__ = ["Deltas"]

# the per-token lists of meta_info that a chunk holds from its first new token on
DELTA_KEYS = frozenset(
    {
        "output_token_logprobs",
        "output_top_logprobs",
        "output_token_ids_logprobs",
        "output_token_sampling_mask",
        "output_token_sampling_logprobs",
    }
)


class Deltas:
    """The incremental chunks of a request's samples: ``deltas(index, chunk)`` is sample
    ``index``'s cumulative ``chunk`` (a native stream's) as what is new since its last."""

    def __init__(self, samples: int) -> None:
        self.sent_ids = [0] * samples  # how many of each sample's ids went out
        self.sent_text = [""] * samples  # and its text that went out

    def __call__(self, index: int, chunk: dict[str, Any]) -> dict[str, Any]:
        out = dict(chunk)
        meta = chunk.get("meta_info")
        ids = chunk.get("output_ids")
        if ids is None or meta is None:
            return out
        if meta.get("finish_reason") == ABORTED_WAITING:  # its last id alone
            out["output_ids"] = ids[-1:]
            return out
        sent = self.sent_ids[index]
        out["output_ids"] = ids[sent:]
        self.sent_ids[index] = len(ids)
        text = chunk.get("text")
        if text is not None:
            said = self.sent_text[index]
            # (a sample's text only grows: what may still change is held back until it settles)
            out["text"] = text[len(said) :] if text.startswith(said) else text
            self.sent_text[index] = text
        sliced = dict(meta)
        for key in DELTA_KEYS & meta.keys():
            if meta[key] is not None:
                sliced[key] = meta[key][sent:]
        out["meta_info"] = sliced
        return out
