"""The ``/generate`` wire format: request validation and SGLang-shaped results.

Field names and defaults follow SGLang 0.5.x (``GenerateReqInput`` and ``SamplingParams``):
``max_new_tokens`` 128, ``temperature`` 1.0 (0 means greedy), ``top_p`` 1.0, ``top_k`` -1 (off),
``min_p`` 0.0, ``ignore_eos`` false, ``sampling_seed`` none, ``n`` 1. Every problem raises
``RequestError`` naming the field, which the server answers with HTTP 400. SGLang parameters
the built-in engine does not implement are accepted only at their neutral default and rejected
otherwise, so a request never silently means something else here. Input log-probs
(``logprob_start_len``, and prefill-only scoring with ``max_new_tokens: 0``) are
``stages.engine.prompt_logprobs``'s; grammars (``json_schema``, ``regex``, ``ebnf``,
``structural_tag``) ``stages.engine.grammar``'s.

Top log-probs (``top_logprobs_num``: k, with ``return_logprob``): per output token the k most
likely tokens of the distribution the sampled token's log-prob comes from (``log_softmax(logits /
temperature)``, or of the logits when greedy), most likely first, as
``meta_info.output_top_logprobs`` ``[[[logprob, token_id, text or None], ...], ...]``.

Stop strings (``stop``: a string or a list of at most 32) as SGLang 0.5 has them
(``Req._check_str_based_finish``, ``DetokenizerManager.trim_matched_stop``): after every sampled
token the end of the output is decoded (as many tokens as the longest stop string has
characters or tokens, plus one) and the first stop string found in it ends the sequence with
``finish_reason {"type": "stop", "matched": "<the string>"}``; the token that completed it is
the last of ``output_ids``. A sample whose last token completes a stop string and also is a
stop token, or the last the length limit allows, finishes by the stop string; one whose last
token is a stop token and the last the length allows, by the token (SGLang 0.5.23's order,
``Req.update_finish_state``). In ``text`` the
matched stop string and what follows it are cut (with ``no_stop_trim``, only what follows it), and
so is the matched stop token of a ``{"matched": <token id>}`` finish (kept with ``no_stop_trim``).
They need the model's tokenizer. So do ``stop_regex`` patterns (``stages.engine.stop_regex``),
looked for after the stop strings in the same decoded tail.

Groups, as SGLang expands them: a batch (``input_ids: [[...], ...]`` or ``text: [...]``) of B
prompts with ``sampling_params.n`` = n asks for B*n samples, answered as one JSON list in
prompt-major order ``[p0 s0..s(n-1), p1 s0, ...]``; a single prompt with n > 1 is a batch of
one (the answer is a list of n). Every entry of a ``sampling_params`` list must ask for the same
n. Request ids: without ``rid`` each sample gets a fresh id; a batch with a ``rid`` string gives
sample k the id ``f"{rid}_{k}"`` (SGLang's expansion); with n > 1 a ``rid`` string gives sample
k of the whole request ``f"{rid}_{k}"`` and a ``rid`` list (one per prompt) gives sample j of
prompt i ``f"{rid[i]}_{j}"``. (SGLang replaces the ids of n > 1 samples with random ones; here
they stay predictable.) Each sample is abortable by its own id, and with n > 1 also by the id
the caller gave, which aborts all of that prompt's (or request's) samples.

This module knows nothing of HTTP, torch or the scheduler.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stages.engine import custom_logits
from stages.engine.context_fit import fit, max_new_given, truncated
from stages.engine.flat_logprobs import FlatTops, flat_fields, flat_request
from stages.engine.images import image_lists
from stages.engine.incremental_text import IncrementalText, output_text
from stages.engine.prompt_embeds import (
    PositionalEmbeds,
    PromptPositions,
    embeds_prompt,
    read_embeds,
)
from stages.engine.request_error import RequestError
from stages.engine.routed_experts import start_error
from stages.engine.stop_regex import parse_stop_regex
from stages.engine.watermark_request import check_watermark

__all__ = [
    "SAMPLING_MASK_MAX_TOKENS",
    "GenerateInput",
    "RequestError",
    "SamplingParams",
    "SequenceResult",
    "add_hidden",
    "answer_version",
    "cached_tokens_details",
    "hidden_answer",
    "is_int",
    "parse_generate",
    "parse_groups",
    "parse_sampling_params",
    "read_prompts",
    "render_result",
    "render_sample",
    "result_text",
    "step_entries",
    "token_texts",
]


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters the built-in engine implements (SGLang names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings
    stop_regex: tuple[str, ...] = ()  # stop patterns (stages.engine.stop_regex)
    # output tokens decoded to look for either (see the module docstring)
    stop_window: int = 0
    no_stop_trim: bool = False
    # a streamed request's chunk after every this many tokens (SGLang's rule: the first, then
    # one every ``stream_interval``); None or 0: the server's ``--stream-interval``
    stream_interval: int | None = None
    # SGLang's penalizers (``srt/sampling/penaltylib``) and logit bias: see ``penalties``
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), each id once
    # (field, text): the grammar the sample must follow (GRAMMAR_FIELDS; stages.engine.grammar)
    grammar: tuple[str, str] | None = None
    # an ``ebnf`` grammar of the whole answer, its reasoning too: it applies from the first
    # token even where the request's reasoning defers grammars (SGLang's ebnf_full_assistant, set
    # by its chat route for GLM-4.7's calls; a SamplingParams field /generate takes too)
    ebnf_full_assistant: bool = False

    @property
    def greedy(self) -> bool:
        # SGLang turns temperature 0 (and top_k 1) into argmax.
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether a penalty, ``min_new_tokens`` or a logit bias changes the logits."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.min_new_tokens
            or self.logit_bias
        )


@dataclass(slots=True)
class GenerateInput:
    """One sequence to generate, validated."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    group_rid: str | None = None  # the caller's rid of an n > 1 request (aborts every sample)
    top_logprobs_num: int = 0  # alternatives reported per output token (with return_logprob)
    logprob_start: int = -1  # input log-probs from this prompt position on (-1: none)
    lora: str | None = None  # the loaded LoRA adapter it takes (``lora_path``), None: the base
    # tokens whose log-probs are reported at every step (``token_ids_logprob``; with
    # return_logprob only), in the order asked
    token_ids_logprob: tuple[int, ...] | None = None
    # its grammar applies once its reasoning ends (SGLang's require_reasoning; the engine's
    # --reasoning-parser says how it ends)
    require_reasoning: bool = False
    # its answer (and each streamed chunk) carries ``prompt_token_ids``, the ids it was given
    # or its text's (SGLang's return_prompt_token_ids)
    return_prompt_token_ids: bool = False
    # the prefix-cache namespace it shares prefixes in: (extra_key, cache_salt), None the
    # default one (SGLang's RadixKey)
    cache_namespace: tuple[str | None, str | None] | None = None
    # each output token's sampling support and behaviour log-prob (return_sampling_mask):
    # "selected" (the sampled token's) or "support" (every supported token's); None: not asked
    sampling_mask: str | None = None
    # which sides of its top log-probs are answered as flat arrays (flat_logprobs); None: none
    flat_tops: FlatTops | None = None
    # its final (normed) hidden states (return_hidden_states): "full" (true: every position
    # each prefill computes, then one a decode step) or "last" (the newest only); None: none
    hidden_states: str | None = None
    # one of n > 1 samples of its prompt (SGLang prefills such a prompt in a warm-up request
    # first, so that each sample's own prefill computes its last position only)
    parallel: bool = False
    # the most tokens it may think before its reasoning's end is forced (max_thinking_tokens,
    # with --enable-strict-thinking; None: the server's budget)
    max_thinking_tokens: int | None = None
    # stop tokens whose text its answer keeps when one ends it (the server's: gpt-oss's
    # <|call|> under --tool-call-parser gpt-oss, as SGLang's detokenizer keeps it)
    kept_stop_ids: frozenset[int] = frozenset()
    # its custom logit processor (the string of custom_logit_processor; None: none), and
    # sampling_params.custom_params as the request sent them (stages.engine.custom_logits)
    logit_processor: str | None = None
    custom_params: Any = None
    # the position its answer's routed experts start at (return_routed_experts, with the
    # server's --enable-return-routed-experts; None: none returned)
    routed_experts: int | None = None
    # the tokens of its own reasoning end tag, which its reasoning ends at (its grammar waits
    # for them, its reasoning tokens counted to them): a K2 Horizon chat request's effort's
    # (custom_params' REASONING_END_KEY, one of the server's selectable ones); None: the server's
    think_end: tuple[int, ...] | None = None
    # the session it belongs to (SGLang's session_id, or its session_params session's id):
    # with --enable-session-radix-cache its KV is held for the session; None: none
    session_id: str | None = None
    # its prompt as embeddings (input_embeds: a float32 tensor [tokens, width], its input_ids
    # then SGLang's stand-ins), which the first pass runs in place of the ids' (None: ids)
    input_embeds: Any = None
    # rows in place of some of its prompt's token embeddings (prompt_embeds.PositionalEmbeds:
    # /v1/score's embedding overrides), which the first pass runs likewise (None: none)
    embed_overrides: PositionalEmbeds | None = None
    # its prompt's position ids where they are not 0, 1, 2... (prompt_embeds.PromptPositions:
    # /v1/score's items under --enable-mis; prefill-only), which its scoring pass runs with
    position_ids: PromptPositions | None = None
    # its prompt's images (images.ImagePrompt: image_data, on a vision model): the rows its
    # image pads take at the first pass, and its rotary positions (None: none)
    images: Any = None
    # its priority (SGLang's ``priority``; None: none asked), which the scheduler orders and
    # preempts by under --enable-priority-scheduling (stages.engine.priority)
    priority: int | None = None


@dataclass(slots=True)
class SequenceResult:
    """What the scheduler hands back for one finished (or aborted) sequence."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    finish_reason: dict[str, Any]
    weight_version: str
    output_token_weight_versions: list[str]
    output_token_logprobs: list[float] | None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cached_weight_version: str | None = None  # the version that computed that KV
    e2e_latency: float = 0.0
    # per output token, the top_logprobs_num most likely (logprob, token id), most likely first
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # from logprob_start_len on: (log-prob or None for the first, token id) per prompt token,
    # and the top_logprobs_num most likely at each (None for the first)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    # with token_ids_logprob: those tokens' (logprob, token id) at each output step, and at
    # each prompt position from logprob_start_len on (None for the first)
    output_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    # its tokens up to and with the end of its reasoning (require_reasoning; else 0)
    reasoning_tokens: int = 0
    retractions: int = 0  # how many times a pause retracted it (SGLang's num_retractions)
    extra: dict[str, Any] = field(default_factory=dict)


# where a request's own reasoning end tag comes, in its sampling parameters' custom_params
# (SGLang's REQUEST_REASONING_END_TOKEN_IDS_KEY), and the most tokens it may have
REASONING_END_KEY = "__sglang_reasoning_end_token_ids"
_REASONING_END_MAX = 32
# Accepted and without effect on the sampling parameters: they only shape text, or
# (``custom_params``) feed the request's custom logit processor (``GenerateInput.custom_params``;
# without one, nothing reads them, as in SGLang).
_IGNORED_SAMPLING = frozenset({"spaces_between_special_tokens", "custom_params"})
# SGLang's ranges (``SamplingParams.verify``)
_PENALTY_RANGES = {
    "frequency_penalty": (-2.0, 2.0, "[-2, 2]"),
    "presence_penalty": (-2.0, 2.0, "[-2, 2]"),
    "repetition_penalty": (0.0, 2.0, "(0, 2] (1.0 = no penalty)"),
}
MAX_STOP_COUNT = 32  # SGLang's limit on stop strings
# at most one a sample (SGLang's SamplingParams.verify)
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")

# Top-level GenerateReqInput fields accepted only at these neutral values.
_NEUTRAL_TOP: dict[str, tuple[Any, ...]] = {
    "image_data": (None,),
    "audio_data": (None,),
    "video_data": (None,),
    "session_params": (None,),
    # SGLang 0.5.23's GenerateReqInput, at the values that change nothing: other values ask for
    # what this engine does not have (multimodal inputs, data-parallel ranks, prefill/decode
    # disaggregation, sessions, a thinking budget)
    "mm_hashes": (None,),
    "mm_content_hashes": (None,),
    "lora_id": (None,),
    "positional_embed_overrides": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "bootstrap_pair_key": (None,),
    "decode_tp_size": (None,),
    "routed_dp_rank": (None, 0),  # one data-parallel rank: 0
    "data_parallel_rank": (None, 0),
    "disagg_prefill_dp_rank": (None, 0),
    "kv_hints": (None,),
    "return_bytes": (False,),
    "multi_item_delimiter_indices": (None,),
    "token_indices_to_pool": (None,),
    "need_wait_for_mm_inputs": (None, False),  # encoder-prefill-decode disaggregation
    "num_items_assigned": (None,),
    "encoder_urls": (None,),
}
# taken and left, as SGLang leaves them by default: logging and metrics labels, a router's
# keys, an entropy SGLang 0.5.23 computes nothing for, ``priority`` (checked as SGLang checks
# it, then the scheduler's: stages.engine.priority); and the multimodal processor's
# settings, which SGLang reads only for images, video or audio (refused above: text only here)
_IGNORED_TOP = frozenset(
    {
        "use_audio_in_video",
        "video_config",
        "images_config",
        "mm_processor_kwargs",
        "max_dynamic_patch",
        "min_dynamic_patch",
        "image_max_dynamic_patch",
        "video_max_dynamic_patch",
        "log_metrics",
        "modalities",
        "no_logs",
        "custom_labels",
        "routing_key",
        "conversation_id",
        "external_trace_header",
        "return_entropy",
        # an indexer's top-k (DeepSeek V3.2's sparse attention): SGLang 0.5.23 answers
        # without them but with --enable-return-indexer-topk on CUDA, and no model here has one
        "return_indexer_topk",
        "priority",
        "received_time",  # when a router took the request, for its metrics
        "http_worker_ipc",  # SGLang's own: which HTTP worker answers
    }
)
_KNOWN_TOP = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "return_logprob",
        "rid",
        "return_text_in_logprobs",
        "top_logprobs_num",
        "logprob_start_len",
        "token_ids_logprob",
        "stream",  # answered by stages.engine.streaming
        "watermark",  # SGLang's, at values that do not watermark (watermark_request)
        "lora_path",  # a loaded adapter's name (stages.engine.lora_adapters)
        "require_reasoning",  # the grammar waits for the end of the reasoning
        "return_prompt_token_ids",  # each answer's prompt ids (its text's, tokenized)
        "extra_key",  # with cache_salt: the prefix-cache namespace (SGLang's RadixKey)
        "cache_salt",
        # not aborted when its client goes away (SGLang's; the route reads it)
        "background",
        # its session: with --enable-session-radix-cache its KV is held for it (radix_sessions)
        "session_id",
        # dropped beside ids or text; else the prompt, cache off (stages.engine.prompt_embeds)
        "input_embeds",
        "return_sampling_mask",  # each token's sampling support and behaviour log-prob
        "sampling_logprobs_mode",
        # top log-probs as flat arrays (stages.engine.flat_logprobs)
        "return_flat_raw_top_logprobs",
        "return_flat_raw_output_top_logprobs",
        "return_flat_raw_top_logprobs_b64",
        "return_hidden_states",  # the final hidden states (with the server's flag)
        "max_thinking_tokens",  # a thinking budget (--enable-strict-thinking)
        "custom_logit_processor",  # with --enable-custom-logit-processor (custom_logits)
        "return_routed_experts",  # the experts of each token (--enable-return-routed-experts)
        "routed_experts_start_len",
    }
)
# More samples than this in one request is refused (a typo in n must not exhaust memory).
MAX_SAMPLES_PER_REQUEST = 65536
# SGLang's --sampling-mask-max-tokens default: the most tokens a returned sampling support holds
SAMPLING_MASK_MAX_TOKENS = 4096
_TOP_K_ALL = 1 << 30  # SGLang's top_k for "the whole vocabulary" (-1), as its messages say it


def parse_generate(
    body: Any,
    *,
    vocab_size: int,
    context_length: int,
    encode: Callable[[str], list[int]] | None,
    adapters: Collection[str] | None = (),
    mask_cap: int = SAMPLING_MASK_MAX_TOKENS,
    hidden_cap: str | None = None,
    strict_thinking: bool = False,
    kept_stop_ids: frozenset[int] = frozenset(),
    custom_logits: bool = False,
    routed_experts: bool = False,
    think_ends: Collection[tuple[int, ...]] = (),
    prefix_cache: bool = True,
    embed_width: int | None = None,
    vision: Any = None,
    auto_truncate: bool = False,
) -> tuple[list[GenerateInput], bool]:
    """Validate a ``/generate`` body; returns the sequences and whether it was a batch.
    ``adapters``: the names of the LoRA adapters loaded, which ``lora_path`` may name (None:
    the engine runs without ``--enable-lora``, and a request naming one is refused);
    ``mask_cap``: the engine's ``--sampling-mask-max-tokens``; ``hidden_cap``: the most its
    ``--return-hidden-states-mode`` returns (``last`` or ``full``; None: no hidden states);
    ``strict_thinking``: whether it runs with ``--enable-strict-thinking``; ``kept_stop_ids``:
    the stop tokens whose text an answer keeps (``GenerateInput.kept_stop_ids``);
    ``custom_logits``: whether it runs with ``--enable-custom-logit-processor``;
    ``routed_experts``: whether it runs with ``--enable-return-routed-experts``;
    ``think_ends``: the reasoning end tags a request may pick (``reasoning_end``);
    ``prefix_cache``: whether the engine's prefix cache is on (SGLang's radix cache);
    ``embed_width``: the model's embedding width, which prompts given as ``input_embeds``
    have (None: none are taken); ``vision``: the model's image reader (``images.Vision``),
    which reads ``image_data`` (None: a text model, which refuses it); ``auto_truncate``:
    whether it runs with ``--allow-auto-truncate`` (``stages.engine.context_fit``)."""
    if not isinstance(body, dict):
        raise RequestError("body", f"expected a JSON object, got {_kind(body)}")
    for key, value in body.items():  # SGLang's other keys: ignored there (ignored_fields)
        if key in _NEUTRAL_TOP and not _is_neutral(value, _NEUTRAL_TOP[key]):
            if key == OVERRIDES and _in_process_overrides(value):
                continue  # /v1/score's, which no JSON body can carry (_embed_overrides)
            if key == "image_data" and vision is not None:
                continue  # read with the prompts (_with_images)
            raise RequestError(key, f"{key}={value!r} is not supported by the built-in engine")
    embedded = embeds_prompt(body, prefix_cache, embed_width)
    priority = body.get("priority")
    if priority is not None and not (is_int(priority) and -(1 << 63) <= priority < (1 << 63)):
        raise RequestError(  # SGLang's words (TokenizerManager._set_default_priority)
            "priority",
            "priority must be a signed 64-bit integer between -9223372036854775808 and "
            "9223372036854775807",
        )
    session = body.get("session_id")
    if session is not None and not isinstance(session, str):  # (an HTTP body: checked before)
        raise RequestError("session_id", f"expected a string, got {_kind(session)}")
    budget = _thinking_budget(body.get("max_thinking_tokens"), strict_thinking)
    for flag in (
        "return_text_in_logprobs",
        "stream",
        "background",
        "require_reasoning",
        "return_prompt_token_ids",
    ):
        if not isinstance(body.get(flag, False), bool | None):
            raise RequestError(flag, f"expected true or false, got {body[flag]!r}")

    embeds: list[Any] = []
    if embedded:
        assert embed_width is not None
        prompts, embeds, batch = read_embeds(body["input_embeds"], embed_width)
    else:
        prompts, batch = read_prompts(body, vocab_size=vocab_size, encode=encode)
    sent: list[int | None] = [None] * len(prompts)  # each prompt's length, where it is cut
    if auto_truncate and (vision is None or body.get("image_data") in (None, [])):
        # SGLang cuts a prompt before checking anything of it (Scheduler
        # .handle_generate_request); one with images is refused as it is (its multimodal path)
        sent = [len(ids) for ids in prompts]
        name = "input_embeds" if embedded else "input_ids"
        prompts = [truncated(ids, context_length, name) for ids in prompts]
        embeds = [rows[: len(ids)] for rows, ids in zip(embeds, prompts, strict=False)]
    raw_params = body.get("sampling_params")
    n = _parallel_n(raw_params, batch)
    listed = batch or n > 1  # SGLang: a single prompt with n > 1 becomes a batch of one
    count = len(prompts)
    images: list[Any] = [None] * count
    if vision is not None and body.get("image_data") not in (None, []):
        if embedded:
            raise RequestError("image_data", "a prompt of input_embeds takes no images")
        images = _with_images(body, prompts, listed, vision)
    if count * n > MAX_SAMPLES_PER_REQUEST:
        raise RequestError(
            "sampling_params.n",
            f"{count} prompts x n={n} is more than {MAX_SAMPLES_PER_REQUEST} samples",
        )
    params = _per_item(raw_params, "sampling_params", count, listed, dict)
    _check_watermarks(body.get("watermark"), params, count)
    logprob_flags = _per_item(body.get("return_logprob"), "return_logprob", count, listed, bool)
    starts = _per_item(body.get("logprob_start_len"), "logprob_start_len", count, listed, int)
    for i, (ids, start) in enumerate(zip(prompts, starts, strict=True)):
        if start is not None and (isinstance(start, bool) or start < -1):
            where = (
                f"logprob_start_len[{i}]"
                if isinstance(body["logprob_start_len"], list)
                else ("logprob_start_len")
            )
            raise RequestError(where, f"expected -1 (none) or a prompt position, got {start!r}")
        if logprob_flags[i] and start is not None and start > len(ids):
            # SGLang (Scheduler.handle_generate_request) refuses it the same way
            raise RequestError(
                "logprob_start_len",
                f"{start} is higher than the number of input tokens {len(ids)}: use a smaller "
                "logprob_start_len",
            )
    tops = _per_item(body.get("top_logprobs_num"), "top_logprobs_num", count, listed, int)
    for i, top in enumerate(tops):
        if top is not None and (isinstance(top, bool) or not 0 <= top <= vocab_size):
            where = (
                f"top_logprobs_num[{i}]"
                if isinstance(body["top_logprobs_num"], list)
                else ("top_logprobs_num")
            )
            raise RequestError(where, f"expected an integer in [0, {vocab_size}], got {top!r}")
    loras = _per_item(body.get("lora_path"), "lora_path", count, listed, str)
    for i, lora in enumerate(loras):
        if lora is not None:
            where = f"lora_path[{i}]" if isinstance(body["lora_path"], list) else "lora_path"
            _check_adapter(lora, adapters, where)
    wanted = _token_ids_logprob(body.get("token_ids_logprob"), count, listed, n, vocab_size)
    keys = _per_item(body.get("extra_key"), "extra_key", count, listed, str)
    salts = _per_item(body.get("cache_salt"), "cache_salt", count, listed, str)
    rids = _sample_rids(body.get("rid"), count, n, batch)
    masks = _sampling_masks(body, count, listed)
    processors = _logit_processors(body, count, listed, n, custom_logits, masks)
    hidden = _hidden_modes(body.get("return_hidden_states"), count, listed, hidden_cap)
    flat = flat_request(body)
    experts_from = _routed_experts_start(body, prompts, routed_experts)
    overrides = _embed_overrides(body.get(OVERRIDES), prompts, embed_width)
    positions = _prompt_positions(body.get(POSITIONS), prompts, params)

    inputs: list[GenerateInput] = []
    parsed: dict[int, SamplingParams] = {}  # one parse per distinct params object
    seen: set[str] = set()
    for i, ids in enumerate(prompts):
        where = f"[{i}]" if listed else ""
        sp = parsed.get(id(params[i]))
        if sp is None:
            sp = _sampling_params(params[i], f"sampling_params{where}", encode)
            check_logit_bias(sp, f"sampling_params{where}", vocab_size)
            parsed[id(params[i])] = sp
        think_end = reasoning_end(params[i], f"sampling_params{where}", vocab_size, think_ends)
        fitted = fit(
            ids, sp, f"{'input_embeds' if embeds else 'input_ids'}{where}", context_length,
            given=max_new_given(params[i]), sent=sent[i],
        )  # fmt: skip
        if masks[i] is not None:
            _check_mask_top_k(sp, f"return_sampling_mask{where}", mask_cap)
        flag = bool(logprob_flags[i])
        top = (tops[i] or 0) if flag else 0  # SGLang: top log-probs come with return_logprob
        # SGLang: without return_logprob the start is ignored; -1 means output log-probs only
        start = starts[i] if flag and starts[i] is not None else -1
        picked = wanted[i] if flag else None  # SGLang reports them with return_logprob only
        for j in range(n):
            rid, group_rid = rids(i, j)
            if rid in seen:
                raise RequestError(f"rid{where}", f"duplicate request id {rid!r} in the batch")
            seen.add(rid)
            think = bool(body.get("require_reasoning"))
            back = bool(body.get("return_prompt_token_ids"))
            space = (keys[i] or None, salts[i] or None)  # "": none, as SGLang's cache_salt
            namespace = None if space == (None, None) else space
            inputs.append(
                GenerateInput(
                    rid,
                    ids,
                    fitted,
                    flag,
                    group_rid,
                    top,
                    start,
                    loras[i],
                    picked,
                    think,
                    return_prompt_token_ids=back,
                    cache_namespace=namespace,
                    sampling_mask=masks[i],
                    flat_tops=flat if top else None,  # only top log-probs come flat
                    hidden_states=hidden[i],
                    parallel=n > 1,
                    max_thinking_tokens=budget,
                    kept_stop_ids=kept_stop_ids,
                    logit_processor=processors[i],
                    custom_params=_custom_params(params[i], budget) if processors[i] else None,
                    routed_experts=experts_from,
                    think_end=think_end,
                    priority=priority,
                    session_id=session,
                    input_embeds=embeds[i] if embeds else None,
                    embed_overrides=overrides[i],
                    position_ids=positions[i],
                    images=images[i],
                )
            )
    return inputs, listed


def _with_images(
    body: dict[str, Any], prompts: list[list[int]], listed: bool, vision: Any
) -> list[Any]:
    """Each prompt's images (``images.ImagePrompt``, None: none), its ids in ``prompts``
    replaced by those with its images' pads (``images.Vision.prompt``)."""
    texts = body.get("text")
    if texts is not None and not isinstance(texts, list):
        texts = [texts]
    out: list[Any] = []
    for i, items in enumerate(image_lists(body["image_data"], len(prompts), listed)):
        if items is None:
            out.append(None)
            continue
        where = f"image_data[{i}]" if listed else "image_data"
        text = texts[i] if texts is not None else None
        prompts[i], image = vision.prompt(text, None if text else prompts[i], items, where)
        out.append(image)
    return out


def reasoning_end(
    params: dict[str, Any] | None,
    where: str,
    vocab_size: int | None,
    allowed: Collection[tuple[int, ...]],
) -> tuple[int, ...] | None:
    """A request's own reasoning end tag (``GenerateInput.think_end``: ``custom_params``'
    ``REASONING_END_KEY``, which the chat route sets for a thinking K2 Horizon request), as
    SGLang's ``get_request_reasoning_end_token_ids`` reads it: RequestError, in its words, for
    what is not a list of 1 to 32 token ids of the vocabulary (``SamplingParams.verify``, on
    every server); None where it is not there or is not one of ``allowed`` (the server's
    selectable end tags: the server's own then)."""
    custom = (params or {}).get("custom_params")
    if not isinstance(custom, dict) or REASONING_END_KEY not in custom:
        return None
    ids = custom[REASONING_END_KEY]
    if (
        not isinstance(ids, list)
        or not 0 < len(ids) <= _REASONING_END_MAX
        or any(type(t) is not int or t < 0 for t in ids)
        or (vocab_size is not None and max(ids) >= vocab_size)
    ):
        raise RequestError(
            f"{where}.custom_params",
            "request reasoning end token IDs must be a non-empty, vocabulary-bounded list of "
            f"at most {_REASONING_END_MAX} integers",
        )
    return tuple(ids) if tuple(ids) in set(allowed) else None


def _routed_experts_start(
    body: dict[str, Any], prompts: list[list[int]], enabled: bool
) -> int | None:
    """Where each sample's routed experts start (``routed_experts_start_len``), or None where
    none are returned: not asked, or asked of a server without
    ``--enable-return-routed-experts``, which SGLang answers without them (no capturer) after
    the same check of the start (``Scheduler.handle_generate_request``: an abort with a 400,
    in its words). One flag and one start for the whole request, as ``GenerateReqInput``
    has them."""
    if not body.get("return_routed_experts"):
        return None
    start = body.get("routed_experts_start_len")
    start = 0 if start is None else start
    for ids in prompts:
        why = start_error(start, len(ids))
        if why is not None:
            raise RequestError("routed_experts_start_len", why)
    return start if enabled else None


def _check_watermarks(top: Any, params: list[dict[str, Any] | None], count: int) -> None:
    """SGLang 0.5.23's ``watermark`` (``watermark_request``): one at the top (or one per prompt
    of a batch: ``GenerateReqInput._normalize_watermark``) or in the sampling parameters, not
    both (``TokenizerManager._tokenize_one_request``); those are checked with the sampling
    parameters, so without one at the top there is nothing to check here."""
    if top is None:
        return
    if isinstance(top, list) and len(top) != count:
        raise RequestError(
            "watermark", "The length of watermark should be equal to the batch size."
        )
    tops = top if isinstance(top, list) else [top] * count
    for own, raw in zip(tops, params, strict=True):
        inner = (raw or {}).get("watermark")
        if own is not None and inner is not None:
            raise RequestError(
                "watermark",
                "watermark must be provided either at the request top level or inside "
                "sampling_params, not both",
            )
        why = check_watermark(own)
        if why is not None:
            raise RequestError("watermark", why)


def _thinking_budget(value: Any, strict: bool) -> int | None:
    """``max_thinking_tokens``: an integer, one for every prompt of the request (SGLang's
    ``GenerateReqInput`` gives each item the same), and only with ``--enable-strict-thinking``
    (refused in SGLang's words without it, ``TokenizerManager.generate_request``)."""
    if value is None:
        return None
    if not strict:
        raise RequestError(
            "max_thinking_tokens",
            "max_thinking_tokens requires the server to be launched with --enable-strict-thinking",
        )
    if not is_int(value):
        raise RequestError("max_thinking_tokens", f"expected an integer, got {value!r}")
    return value


def _logit_processors(
    body: dict[str, Any],
    count: int,
    listed: bool,
    n: int,
    enabled: bool,
    masks: list[str | None],
) -> list[str | None]:
    """Each prompt's ``custom_logit_processor`` (None: none, "" too), loaded here so that one
    that cannot be used is refused naming it (SGLang's scheduler would fail on it later);
    without ``--enable-custom-logit-processor``, with a list and ``n`` > 1, and with
    ``return_sampling_mask`` for one that does more than ban tokens, SGLang's refusals
    (``TokenizerManager._validate_one_request``, ``_normalize_custom_logit_processor``)."""
    name = "custom_logit_processor"
    value = body.get(name)
    if not value:
        return [None] * count
    if not enabled:
        raise RequestError(
            name,
            "The server is not configured to enable custom logit processor. Please set "
            "`--enable-custom-logit-processor` to enable this feature.",
        )
    if isinstance(value, list) and n > 1:
        raise RequestError(
            name, "Cannot use list custom_logit_processor with parallel_sample_num > 1"
        )
    texts = _per_item(value, name, count, listed, str)
    for i, text in enumerate(texts):
        if not text:
            continue
        where = f"{name}[{i}]" if isinstance(value, list) else name
        try:
            custom_logits.processor_class(text)
        except custom_logits.ProcessorError as exc:
            raise RequestError(where, f"cannot load the processor: {exc}") from None
        if masks[i] is not None and not custom_logits.masks_safely(text):
            raise RequestError(
                where,
                "return_sampling_mask only supports DisallowedTokensLogitsProcessor among "
                "custom logit processors.",
            )
    return [text or None for text in texts]


def _custom_params(raw: dict[str, Any] | None, budget: int | None) -> Any:
    """A processor's ``custom_params`` of its sampling parameters, with ``max_thinking_tokens``
    as ``thinking_budget`` (SGLang's ``_create_tokenized_object``)."""
    found = (raw or {}).get("custom_params")
    if budget is not None and isinstance(found, dict | None):
        found = {**(found or {}), "thinking_budget": budget}
    return found


def _sampling_masks(body: dict[str, Any], count: int, listed: bool) -> list[str | None]:
    """Each prompt's ``return_sampling_mask`` as the mode its log-probs are in (``selected``,
    the default, or ``sampling_logprobs_mode``'s ``support``), None where not asked; a mode
    without the mask is refused in SGLang's words (``TokenizerManager._validate_one_request``)."""
    name = "sampling_logprobs_mode"
    flags = _per_item(body.get("return_sampling_mask"), "return_sampling_mask", count, listed, bool)
    modes = _per_item(body.get(name), name, count, listed, str)
    out: list[str | None] = []
    for i, (flag, mode) in enumerate(zip(flags, modes, strict=True)):
        where = f"{name}[{i}]" if isinstance(body.get(name), list) else name
        if mode is not None and mode not in ("selected", "support"):
            raise RequestError(where, f"Input should be 'selected' or 'support', got {mode!r}")
        if mode is not None and not flag:
            raise RequestError(
                where, "sampling_logprobs_mode can only be set when return_sampling_mask=true."
            )
        out.append((mode or "selected") if flag else None)
    return out


_HIDDEN_MODES = {None: 0, "last": 1, "full": 2}  # CaptureHiddenMode's order


def add_hidden(hidden: list[Any], new: list[Any], mode: str | None) -> None:
    """A sample's hidden states with ``new`` ones added: "last" keeps the newest alone
    (SGLang's ``_append_decode_hidden_states``), "full" all of them."""
    if mode == "last":
        if new:
            hidden[:] = new[-1:]
    else:
        hidden += new


def hidden_answer(hidden: list[Any] | None, mode: str | None) -> Any:
    """``meta_info.hidden_states`` of a sample's hidden states: all of them ("full"), the
    newest ("last"; None before any, which SGLang leaves out), None when not asked."""
    if hidden is None or mode != "last":
        return hidden
    return hidden[-1] if hidden else None


def _hidden_modes(value: Any, count: int, listed: bool, cap: str | None) -> list[str | None]:
    """Each prompt's ``return_hidden_states`` (true, false or ``"last"``; a batch may give one
    per prompt) as ``"full"``, ``"last"`` or None, refused in SGLang's words when not one of
    those (``get_return_hidden_states_mode``) or beyond what the server returns (``cap``:
    ``TokenizerManager._validate_one_request``)."""
    name = "return_hidden_states"
    if listed and isinstance(value, list):
        if len(value) != count:
            raise RequestError(
                name, "The length of return_hidden_states should be equal to the batch size."
            )
        items = value
    else:
        items = [value] * count
    modes: list[str | None] = []
    for item in items:
        if item is True:
            modes.append("full")
        elif item == "last":
            modes.append("last")
        elif item is False or item is None:
            modes.append(None)
        else:
            raise RequestError(
                name, "return_hidden_states must be a boolean or the string literal 'last'."
            )
    wanted = max(_HIDDEN_MODES[m] for m in modes) if modes else 0
    if wanted > _HIDDEN_MODES[cap]:
        if cap is not None:
            raise RequestError(
                name,
                f"The requested return_hidden_states mode exceeds the server maximum `{cap}`. "
                "Please launch with `--return-hidden-states-mode full` to allow "
                "return_hidden_states=True.",
            )
        raise RequestError(
            name,
            "The server is not configured to return hidden states. Please set "
            "`--return-hidden-states-mode last`, `--return-hidden-states-mode full`, or the "
            "legacy `--enable-return-hidden-states` flag.",
        )
    return modes


def _check_mask_top_k(params: SamplingParams, where: str, cap: int) -> None:
    """SGLang's scheduler refuses a sampling mask whose support may be unbounded: greedy, or
    a finite top_k up to ``--sampling-mask-max-tokens`` (``Scheduler.handle_generate_request``)."""
    top_k = 1 if params.greedy else (_TOP_K_ALL if params.top_k == -1 else params.top_k)
    if top_k != 1 and not 1 < top_k <= cap:
        raise RequestError(
            where,
            "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
            f"{cap}; got top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens.",
        )


def parse_sampling_params(
    raw: dict[str, Any] | None, encode: Callable[[str], list[int]] | None = None
) -> SamplingParams:
    """``sampling_params`` for ``parse_groups`` (one sample per request id: ``n`` must be 1),
    checked as ``parse_generate`` checks them."""
    if raw is not None and not isinstance(raw, dict):
        raise RequestError("sampling_params", f"expected dict, got {_kind(raw)}")
    if _parallel_n(raw, True) != 1:
        raise RequestError("sampling_params.n", "one sample per request id here: leave n at 1")
    return _sampling_params(raw, "sampling_params", encode)


# GenerateReqInput fields a caller's sampling parameters may carry (a rollout engine's
# keywords, the generator's sampling config): they go at the request's top level
REQUEST_LEVEL_FIELDS = ("require_reasoning", "max_thinking_tokens", "custom_logit_processor")


def request_options(
    sampling: Mapping[str, Any],
    *,
    strict_thinking: bool = False,
    custom_logits: bool = False,
    vocab_size: int | None = None,
    think_ends: Collection[tuple[int, ...]] = (),
) -> dict[str, Any]:
    """The ``GenerateInput`` fields that ``REQUEST_LEVEL_FIELDS`` among ``sampling`` (and its
    ``custom_params``: a processor's, a reasoning end tag among ``think_ends``) set, checked as
    ``parse_generate`` checks them at a body's top level; for ``parse_groups``' groups, whose
    requests have no body."""
    flag = sampling.get("require_reasoning", False)
    if not isinstance(flag, bool | None):
        raise RequestError("require_reasoning", f"expected true or false, got {flag!r}")
    budget = _thinking_budget(sampling.get("max_thinking_tokens"), strict_thinking)
    (processor,) = _logit_processors(dict(sampling), 1, False, 1, custom_logits, [None])
    custom = _custom_params(dict(sampling), budget) if processor else None
    return {
        "require_reasoning": bool(flag),
        "max_thinking_tokens": budget,
        "logit_processor": processor,
        "custom_params": custom,
        "think_end": reasoning_end(dict(sampling), "sampling_params", vocab_size, think_ends),
    }


def parse_groups(
    prompts: Sequence[Any],
    params: SamplingParams,
    rids: Sequence[Sequence[str]],
    *,
    vocab_size: int,
    context_length: int,
    lora: str | None = None,
    adapters: Collection[str] | None = (),
    options: Mapping[str, Any] | None = None,
    auto_truncate: bool = False,
) -> list[list[GenerateInput]]:
    """Groups of samples of one prompt each (``len(rids[i])`` samples of ``prompts[i]``, with
    log-probs, one set of ``params`` from ``parse_sampling_params``, the adapter ``lora``): what
    ``parse_generate`` gives for the body that lists each prompt once per sample with its rid,
    checked as it checks that body, with the same errors, but each prompt once and without
    the body. A generator's engine in its own process (``stages.engine.in_process``) takes
    them this way. ``adapters``: as ``parse_generate``'s; ``options``: ``GenerateInput``
    fields for every sample
    (``request_options``); ``auto_truncate``: whether the engine runs with
    ``--allow-auto-truncate`` (``stages.engine.context_fit``)."""
    count = sum(len(group) for group in rids)
    if count == 0:
        raise RequestError("input_ids", "empty")
    if count > MAX_SAMPLES_PER_REQUEST:
        raise RequestError(
            "sampling_params.n",
            f"{count} prompts x n=1 is more than {MAX_SAMPLES_PER_REQUEST} samples",
        )
    _check_adapter(lora, adapters, "lora_path")
    check_logit_bias(params, "sampling_params", vocab_size)
    more = dict(options or {})
    out: list[list[GenerateInput]] = []
    seen: set[str] = set()
    offset = 0
    for ids, group in zip(prompts, rids, strict=True):
        inputs: list[GenerateInput] = []
        if group:
            name = f"input_ids[{offset}]"
            if not isinstance(ids, list):
                raise RequestError(name, f"expected a list of token ids, got {_kind(ids)}")
            if not ids:
                raise RequestError(name, "empty")
            if not _valid_ids(ids, vocab_size):
                _explain_ids(ids, name, vocab_size)
            sent = None
            if auto_truncate:
                sent, ids = len(ids), truncated(ids, context_length, name)
            fitted = fit(ids, params, name, context_length, given=True, sent=sent)
        for rid in group:
            if not isinstance(rid, str):
                raise RequestError(f"rid[{offset}]", f"expected str, got {_kind(rid)}")
            if rid in seen:
                raise RequestError(f"rid[{offset}]", f"duplicate request id {rid!r} in the batch")
            seen.add(rid)
            inputs.append(GenerateInput(rid, ids, fitted, True, None, 0, -1, lora, **more))
            offset += 1
        out.append(inputs)
    return out


def _check_adapter(lora: str | None, adapters: Collection[str] | None, where: str) -> None:
    """A request's ``lora_path`` names a loaded adapter (``adapters``; None: the engine runs
    without SGLang's ``--enable-lora``, whose words refuse any)."""
    if lora is None:
        return
    if adapters is None:
        raise RequestError(
            where,
            f"LoRA adapter '{lora}' was requested, but LoRA is not enabled. Please launch the "
            "server with --enable-lora flag and preload adapters using --lora-paths or "
            "/load_lora_adapter endpoint.",
        )
    if lora not in adapters:
        raise RequestError(
            where,
            f"no LoRA adapter {lora!r} is loaded (loaded: {sorted(adapters)}); "
            "POST /load_lora_adapter first",
        )


def _token_ids_logprob(
    value: Any, count: int, listed: bool, n: int, vocab_size: int
) -> list[tuple[int, ...] | None]:
    """``token_ids_logprob`` for each prompt, as SGLang takes it (``GenerateReqInput``'s
    normalization, ``TokenizerManager._validate_token_ids_logprob``): null or [] for none; a
    single request gives a list of token ids; a batch (or ``n`` > 1) a token id, a list for
    every prompt, or a list of lists, one per prompt (not with ``n`` > 1)."""
    if not value:
        return [None] * count
    name = "token_ids_logprob"
    if listed and is_int(value):
        value = [value]
    if not isinstance(value, list):
        raise RequestError(name, "must be a flat list of integers")
    if listed and isinstance(value[0], list):
        if n > 1:
            raise RequestError(name, "cannot be a list of lists with n > 1")
        if len(value) != count:
            raise RequestError(name, f"has {len(value)} lists for a batch of {count} prompts")
        per_prompt = [(f"{name}[{i}]", ids) for i, ids in enumerate(value)]
    else:
        per_prompt = [(name, value)] * count
    out: list[tuple[int, ...] | None] = []
    for where, ids in per_prompt:
        if not isinstance(ids, list) or not all(is_int(t) for t in ids):
            raise RequestError(where, "must be a flat list of integers")
        for tok in ids:
            if not 0 <= tok < vocab_size:
                raise RequestError(
                    where,
                    f"contains out-of-vocabulary token id {tok}; valid range is [0, {vocab_size})",
                )
        out.append(tuple(ids))
    return out


def render_result(
    result: SequenceResult,
    *,
    decode: Callable[[list[int], bool], str] | None,
    skip_special_tokens: bool,
    return_logprob: bool,
    no_stop_trim: bool = False,
    token_text: Callable[[int], str] | None = None,
    prompt_ids: Sequence[int] = (),
    state: IncrementalText | None = None,
    flat: FlatTops | None = None,
    top_k: int = 0,
    sent: bool = True,
    kept_stop_ids: Collection[int] = (),
) -> dict[str, Any]:
    """One ``/generate`` result laid out as SGLang does (``text`` only with a tokenizer, decoded
    after ``prompt_ids``' last tokens as SGLang does; ``token_text``: each log-prob entry's
    third slot, ``return_text_in_logprobs``; ``flat``: the sides of its ``top_k`` top
    log-probs laid out as flat arrays, ``flat_logprobs``). ``sent``: ``meta_info`` ends with
    ``response_sent_to_client_ts``, the Unix time it is sent at, as SGLang 0.5.23 stamps an
    answer (a stream's first chunk only: a later last chunk passes False)."""
    # SGLang's order (TokenizerManager._handle_batch_output): who and why, the scheduler's
    # time stats, the log-probs, the sampling masks, the counts, the versions, the hidden
    # states, the latency
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "weight_version": answer_version(result),
        "num_retractions": result.retractions,
    }
    extra = result.extra
    if extra:  # --enable-metrics' time stats
        meta.update((k, v) for k, v in extra.items() if k not in _AFTER_LOGPROBS)
    if return_logprob:
        logprobs = result.output_token_logprobs or []
        meta["input_token_logprobs"] = [
            [lp, tok, None if token_text is None else token_text(tok)]
            for lp, tok in result.input_token_logprobs or ()  # logprob_start_len -1: none
        ]
        # SGLang's layout: [logprob, token_id, token_text or None].
        meta["output_token_logprobs"] = [
            [lp, tok, None if token_text is None else token_text(tok)]
            for lp, tok in zip(logprobs, result.output_ids, strict=True)
        ]
        meta["output_token_logprobs_length"] = len(logprobs)
        if result.output_top_logprobs is not None:
            _top_entries(meta, result, token_text, flat, top_k)
        if result.output_token_ids_logprobs is not None:
            meta["input_token_ids_logprobs"] = step_entries(
                result.input_token_ids_logprobs or (), token_text
            )
            meta["output_token_ids_logprobs"] = step_entries(
                result.output_token_ids_logprobs, token_text
            )
    if extra:  # the sampling masks
        meta.update((k, v) for k, v in extra.items() if k in _MASK_FIELDS)
    meta["reasoning_tokens"] = result.reasoning_tokens
    meta["completion_tokens"] = len(result.output_ids)
    meta["cached_tokens"] = result.cached_tokens
    meta["weight_versions"] = _version_spans(
        result.output_token_weight_versions, result.weight_version
    )
    meta["output_token_weight_versions"] = result.output_token_weight_versions  # Inflight's
    meta["cached_tokens_details"] = cached_tokens_details(result.cached_tokens)
    # Inflight's: the version whose weights computed the cached prefix (null: none)
    meta["cached_weight_version"] = result.cached_weight_version
    if extra and "hidden_states" in extra:
        meta["hidden_states"] = extra["hidden_states"]
    if extra and "routed_experts" in extra:  # after the hidden states, as SGLang's
        meta["routed_experts"] = extra["routed_experts"]
    meta["e2e_latency"] = result.e2e_latency
    if sent:
        meta["response_sent_to_client_ts"] = time.time()
    out: dict[str, Any] = {}
    if decode is not None:
        out["text"] = result_text(
            result, decode, skip_special_tokens, no_stop_trim, prompt_ids, state, kept_stop_ids
        )
    out["output_ids"] = result.output_ids
    out["meta_info"] = meta
    return out


# what a finished sample's ``extra`` holds besides its time stats, in SGLang's place for them
_MASK_FIELDS = (
    "output_token_sampling_mask",
    "output_token_sampling_logprobs",
    "output_token_sampling_mask_length",
)
_AFTER_LOGPROBS = frozenset({*_MASK_FIELDS, "hidden_states", "routed_experts"})


def _top_entries(
    meta: dict[str, Any],
    result: SequenceResult,
    token_text: Callable[[int], str] | None,
    flat: FlatTops | None,
    top_k: int,
) -> None:
    """``meta``'s top log-probs, the input's then the output's: each side nested, or as
    ``flat`` asks (nested where its rows cannot be laid out flat)."""
    for side, steps in (
        ("input", result.input_top_logprobs or []),
        ("output", result.output_top_logprobs or []),
    ):
        fields = None
        if flat is not None and (flat.input if side == "input" else flat.output):
            fields = flat_fields(side, steps, top_k, flat.b64, result.rid)
        if fields is None:
            meta[f"{side}_top_logprobs"] = step_entries(steps, token_text)
        else:
            meta.update(fields)


def token_texts(
    decode: Callable[[list[int], bool], str] | None, body: Any
) -> Callable[[int], str] | None:
    """Each log-prob entry's text with ``return_text_in_logprobs`` (SGLang: each token decoded
    alone, special tokens kept); None otherwise. A token's text is decoded once per ``decode``
    (a streamed sample's tokens come up again in its last chunk, and across requests)."""
    if decode is None or not body.get("return_text_in_logprobs"):
        return None
    text = _TOKEN_TEXTS.get(decode)
    if text is None:  # the cache holds ``decode`` weakly, as its key does
        alive = weakref.ref(decode)
        text = functools.lru_cache(maxsize=_TOKEN_TEXT_CACHE)(
            lambda token: alive()([token], False)  # type: ignore[misc]
        )
        _TOKEN_TEXTS[decode] = text
    return text


# each decode function's token texts (a tokenizer's bound ``decode`` takes no attribute)
_TOKEN_TEXTS: weakref.WeakKeyDictionary[Any, Callable[[int], str]] = weakref.WeakKeyDictionary()
_TOKEN_TEXT_CACHE = 1 << 17  # tokens whose text is kept: a large vocabulary's


def render_sample(
    inp: GenerateInput,
    result: SequenceResult,
    decode: Callable[[list[int], bool], str] | None,
    token_text: Callable[[int], str] | None,
    state: IncrementalText | None = None,
    sent: bool = True,
) -> dict[str, Any]:
    """``render_result`` of ``result`` with what its request ``inp`` asked for (``state``: a
    streamed sample's text so far; ``sent``: not after an earlier chunk), and its
    ``prompt_token_ids`` after ``meta_info`` when asked (as SGLang's ``TokenizerManager`` adds
    them)."""
    out = render_result(
        result,
        decode=decode,
        skip_special_tokens=inp.params.skip_special_tokens,
        return_logprob=inp.return_logprob,
        no_stop_trim=inp.params.no_stop_trim,
        token_text=token_text,
        prompt_ids=inp.input_ids,
        state=state,
        flat=inp.flat_tops,
        top_k=inp.top_logprobs_num,
        sent=sent,
        kept_stop_ids=inp.kept_stop_ids,
    )
    if inp.return_prompt_token_ids:
        out["prompt_token_ids"] = list(inp.input_ids)
    return out


def _text(token_text: Callable[[int], str] | None, token: int) -> str | None:
    return None if token_text is None else token_text(token)


def step_entries(
    steps: Sequence[Sequence[tuple[float, int]] | None], token_text: Callable[[int], str] | None
) -> list[list[list[Any]] | None]:
    """SGLang's entries of top log-probs or ``token_ids_logprob``: per step a list of
    ``[logprob, token_id, text or None]`` (a step without any: None)."""
    return [
        None if step is None else [[lp, tok, _text(token_text, tok)] for lp, tok in step]
        for step in steps
    ]


def result_text(
    result: SequenceResult,
    decode: Callable[[list[int], bool], str],
    skip_special_tokens: bool,
    no_stop_trim: bool = False,
    prompt_ids: Sequence[int] = (),
    state: IncrementalText | None = None,
    kept: Collection[int] = (),
) -> str:
    """The output's text as SGLang's detokenizer gives it: decoded after the prompt's last
    tokens (``incremental_text``; ``state``: a streamed sample's own, else one taken through a
    request not streamed), without the matched stop token, and cut before a matched stop
    string (``no_stop_trim``: both kept, what follows cut); a stop token of ``kept`` stays."""
    matched = result.finish_reason.get("matched") if result.finish_reason else None
    ids = result.output_ids
    trim = isinstance(matched, int) and not isinstance(matched, bool) and bool(ids)
    trim = trim and not no_stop_trim and ids[-1] not in kept
    if state is None:
        text = output_text(prompt_ids, ids, decode, skip_special_tokens, trim)
    else:
        text = state.final(ids, trim)
    if isinstance(matched, str):
        at = text.find(matched)
        if at != -1:
            text = text[: at + len(matched)] if no_stop_trim else text[:at]
    return text


def answer_version(result: SequenceResult) -> str:
    """A finished sample's ``meta_info.weight_version`` as SGLang 0.5.23 writes it: the version
    of its last token (``add_weight_versions_to_meta_info`` sets the last span's), else, with
    none, the live one. They differ for a sample aborted after an update that came once its
    last token was drawn (a retracted one, say)."""
    versions = result.output_token_weight_versions
    return versions[-1] if versions else result.weight_version


def cached_tokens_details(cached_tokens: int) -> dict[str, int] | None:
    """``meta_info.cached_tokens_details`` (SGLang 0.5.23's ``get_cached_tokens_details``
    without a host cache or storage tier: every cached token came from the device's cache;
    none cached: null)."""
    return {"device": cached_tokens, "host": 0} if cached_tokens > 0 else None


def _version_spans(versions: list[str], current: str) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions``: ``[{version, start, end}]`` over output tokens;
    none: one empty span of the ``current`` version (``compute_weight_version_spans``)."""
    if not versions:
        return [{"version": current, "start": 0, "end": 0}]
    if versions.count(versions[0]) == len(versions):  # the usual case: one version
        return [{"version": versions[0], "start": 0, "end": len(versions)}]
    spans: list[dict[str, Any]] = []
    start = 0
    for version, run in itertools.groupby(versions):
        end = start + len(list(run))
        spans.append({"version": version, "start": start, "end": end})
        start = end
    return spans


_RID_PREFIX = uuid.uuid4().hex[:16]
_RID_COUNTER = itertools.count()


def _new_rid() -> str:
    """A fresh 32-hex-digit request id (uuid4 costs ~4 us; this, a fraction of that)."""
    return f"{_RID_PREFIX}{next(_RID_COUNTER):016x}"


def _parallel_n(raw: Any, batch: bool) -> int:
    """SGLang's ``n``: one value for the whole request (every list entry must agree)."""
    entries = raw if isinstance(raw, list) else [raw]
    n_first: int | None = None
    for i, entry in enumerate(entries):
        value = entry.get("n") if isinstance(entry, dict) else None
        value = 1 if value is None else value
        name = f"sampling_params[{i}].n" if isinstance(raw, list) else "sampling_params.n"
        if not is_int(value) or value < 1:
            raise RequestError(name, f"expected an integer >= 1, got {value!r}")
        if n_first is None:
            n_first = value
        elif value != n_first:
            raise RequestError(
                name,
                f"is {value} but sampling_params[0].n is {n_first}: every entry of a "
                "sampling_params list must ask for the same n",
            )
    return n_first or 1


def _sample_rids(
    value: Any, count: int, n: int, batch: bool
) -> Callable[[int, int], tuple[str, str | None]]:
    """(rid, group rid) of sample ``j`` of prompt ``i``; see the module docstring."""
    if value is None:
        return lambda i, j: (_new_rid(), None)
    if isinstance(value, str):
        if n > 1:
            return lambda i, j: (f"{value}_{i * n + j}", value)
        if batch:
            return lambda i, j: (f"{value}_{i}", None)
        return lambda i, j: (value, None)
    if isinstance(value, list) and (batch or n > 1):
        if len(value) != count:
            raise RequestError("rid", f"has {len(value)} entries for a batch of {count}")
        for i, rid in enumerate(value):
            if not isinstance(rid, str):
                raise RequestError(f"rid[{i}]", f"expected str, got {_kind(rid)}")
        if n > 1:
            return lambda i, j: (f"{value[i]}_{j}", value[i])
        return lambda i, j: (value[i], None)
    raise RequestError("rid", f"expected str, got {_kind(value)}")


def read_prompts(
    body: dict[str, Any], *, vocab_size: int, encode: Callable[[str], list[int]] | None
) -> tuple[list[list[int]], bool]:
    """The prompts of a body's ``text`` or ``input_ids`` (exactly one), one or a batch, as
    token ids checked against the vocabulary; and whether it was a batch."""
    has_ids = body.get("input_ids") is not None
    has_text = body.get("text") is not None
    if has_ids == has_text:
        raise RequestError("input_ids", "give exactly one of input_ids or text")
    if has_text:
        text = body["text"]
        if encode is None:
            raise RequestError("text", "this model has no tokenizer: send input_ids")
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if batch and not texts:
            raise RequestError("text", "empty batch")
        prompts = []
        for i, t in enumerate(texts):
            name = f"text[{i}]" if batch else "text"
            if not isinstance(t, str):
                raise RequestError(name, f"expected a string, got {_kind(t)}")
            ids = encode(t)
            if not ids:
                raise RequestError(name, "encodes to no tokens")
            prompts.append(ids)
        return prompts, batch

    ids = body["input_ids"]
    if not isinstance(ids, list):
        raise RequestError("input_ids", f"expected a list of token ids, got {_kind(ids)}")
    if not ids:
        raise RequestError("input_ids", "empty")
    batch = isinstance(ids[0], list)
    rows = ids if batch else [ids]
    prompts = []
    for i, row in enumerate(rows):
        name = f"input_ids[{i}]" if batch else "input_ids"
        if not isinstance(row, list):
            raise RequestError(name, f"expected a list of token ids, got {_kind(row)}")
        if not row:
            raise RequestError(name, "empty")
        if prompts and row == prompts[-1]:
            prompts.append(prompts[-1])  # a group's copies: checked once, shared
            continue
        if not _valid_ids(row, vocab_size):
            _explain_ids(row, name, vocab_size)
        prompts.append(row)
    return prompts, batch


def _valid_ids(row: list[Any], vocab_size: int) -> bool:
    """The fast check (C loops): all plain ints within the vocabulary."""
    return all(type(t) is int for t in row) and 0 <= min(row) and max(row) < vocab_size


def _explain_ids(row: list[Any], name: str, vocab_size: int) -> None:
    for j, tok in enumerate(row):
        if not is_int(tok):
            raise RequestError(f"{name}[{j}]", f"expected an integer token id, got {tok!r}")
        if not 0 <= tok < vocab_size:
            raise RequestError(
                f"{name}[{j}]", f"token id {tok} is outside the vocabulary [0, {vocab_size})"
            )


def _per_item(value: Any, name: str, n: int, batch: bool, kind: type) -> list[Any]:
    """A field that is one value for all sequences or (in a batch) a list of one per sequence."""
    if value is None:
        return [None] * n
    if batch and isinstance(value, list):
        if len(value) != n:
            raise RequestError(name, f"has {len(value)} entries for a batch of {n}")
        items = value
    else:
        items = [value] * n
    for i, item in enumerate(items):
        if item is not None and not isinstance(item, kind):
            where = f"{name}[{i}]" if items is value else name
            raise RequestError(where, f"expected {kind.__name__}, got {_kind(item)}")
    return items


def _beam_width(value: Any, path: str) -> None:
    """``beam_width``: null or 1 (plain sampling) taken; less, SGLang's refusal; more, a beam
    search this engine does not run."""
    if value is None:
        return
    if not is_int(value):
        raise RequestError(path, f"expected int, got {_kind(value)}")
    if value < 1:
        raise RequestError(path, f"beam_width must be at least 1, got {value}.")
    if value > 1:
        raise RequestError(path, "beam search (beam_width > 1) is not supported by this engine")


def _sampling_params(
    raw: dict[str, Any] | None, name: str, encode: Callable[[str], list[int]] | None = None
) -> SamplingParams:
    raw = raw or {}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{name}.{key}"
        if key in _IGNORED_SAMPLING or key == "n":  # n: see _parallel_n
            continue
        if key == "beam_width":  # SGLang 0.5.23's beam search: null and 1 are sampling
            _beam_width(value, path)
            continue
        if key == "watermark":  # none, or turned off: this engine does not watermark
            why = check_watermark(value)
            if why is not None:
                raise RequestError(path, why)
            continue
        if key == "stop":
            values.update(_stop_strings(value, path, encode))
            continue
        if key == "stop_regex":
            values.update(_stop_patterns(value, path, encode))
            continue
        if key in GRAMMAR_FIELDS:
            if value is None or value == "":  # SGLang: `json_schema or None`
                continue
            if not isinstance(value, str):
                raise RequestError(path, f"expected the grammar as a string, got {_kind(value)}")
            if "grammar" in values:
                raise RequestError(
                    path, "Only one of json_schema, regex, ebnf, or structural_tag can be set."
                )
            if encode is None:
                raise RequestError(path, "grammars need the model's tokenizer; this model has none")
            values["grammar"] = (key, value)
            continue
        if value is None:
            continue  # SGLang: null means the default
        if key in ("max_new_tokens", "top_k", "sampling_seed", "stream_interval", "min_new_tokens"):
            if not is_int(value):
                raise RequestError(path, f"expected an integer, got {value!r}")
        elif key in ("temperature", "top_p", "min_p") or key in _PENALTY_RANGES:
            if not _is_number(value) or not math.isfinite(value):
                raise RequestError(path, f"expected a finite number, got {value!r}")
            value = float(value)
        elif key == "logit_bias":
            value = _logit_bias(value, path)
        elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "ebnf_full_assistant"):
            if not isinstance(value, bool):
                raise RequestError(path, f"expected true or false, got {value!r}")
        elif key == "stop_token_ids":
            if not isinstance(value, list) or not all(is_int(t) for t in value):
                raise RequestError(path, "expected a list of integer token ids")
            value = frozenset(value)
        else:
            raise RequestError(path, "unknown sampling parameter")
        values[key] = value
    if "stop_regex_window" in values:  # one tail for both (SGLang's Req.tail_str)
        values["stop_window"] = max(values.pop("stop_regex_window"), values.get("stop_window", 0))
    sp = SamplingParams(**values)
    if sp.max_new_tokens < 0:
        raise RequestError(f"{name}.max_new_tokens", f"must be >= 0, got {sp.max_new_tokens}")
    if sp.temperature < 0:
        raise RequestError(f"{name}.temperature", f"must be >= 0, got {sp.temperature}")
    if not 0.0 < sp.top_p <= 1.0:
        raise RequestError(f"{name}.top_p", f"must be in (0, 1], got {sp.top_p}")
    if not 0.0 <= sp.min_p <= 1.0:
        raise RequestError(f"{name}.min_p", f"must be in [0, 1], got {sp.min_p}")
    if sp.top_k != -1 and sp.top_k < 1:
        raise RequestError(f"{name}.top_k", f"must be -1 (off) or >= 1, got {sp.top_k}")
    for key, (low, high, shown) in _PENALTY_RANGES.items():
        value = getattr(sp, key)
        if not (low < value if key == "repetition_penalty" else low <= value) or value > high:
            raise RequestError(f"{name}.{key}", f"must be in {shown}, got {value}")
    if not 0 <= sp.min_new_tokens <= sp.max_new_tokens:
        raise RequestError(
            f"{name}.min_new_tokens",
            f"must be in [0, max_new_tokens ({sp.max_new_tokens})], got {sp.min_new_tokens}",
        )
    if sp.sampling_seed is not None and not -(2**63) <= sp.sampling_seed < 2**63:
        raise RequestError(  # SGLang's SamplingParams.verify, in its words
            f"{name}.sampling_seed",
            f"sampling_seed must be in [-2**63, 2**63 - 1], got {sp.sampling_seed}.",
        )
    return sp


def _logit_bias(value: Any, path: str) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (``{"<token id>": bias}``) as (id, bias) pairs, each id once (SGLang
    keys them by ``int(key)``: "1" and "01" are one token, the later value kept); the ids'
    range is checked against the vocabulary by ``check_logit_bias``."""
    if not isinstance(value, dict):
        raise RequestError(path, f'expected an object {{"<token id>": bias}}, got {_kind(value)}')
    bias: dict[int, float] = {}
    for key, amount in value.items():
        try:
            token = key if is_int(key) else int(str(key).strip())
        except ValueError:
            raise RequestError(f"{path}.{key}", "keys must be token ids (integers)") from None
        if not _is_number(amount) or not math.isfinite(amount):
            raise RequestError(f"{path}.{key}", f"expected a finite number, got {amount!r}")
        bias[token] = float(amount)
    return tuple(bias.items())


def check_logit_bias(sp: SamplingParams, name: str, vocab_size: int) -> None:
    """SGLang's check that every ``logit_bias`` key is a token of the vocabulary."""
    for token, _ in sp.logit_bias:
        if not 0 <= token < vocab_size:
            raise RequestError(
                f"{name}.logit_bias",
                f"keys must be token ids in [0, {vocab_size - 1}], got {token}",
            )


def _stop_strings(
    value: Any, path: str, encode: Callable[[str], list[int]] | None
) -> dict[str, Any]:
    """``stop`` and ``stop_window`` from ``sampling_params.stop`` (null or [] means none; a
    string is a list of one, even "", which SGLang matches at once)."""
    if value is None:
        return {}
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(path, "expected a string or a list of strings")
    if len(stops) > MAX_STOP_COUNT:
        raise RequestError(
            path, f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stops)}"
        )
    if not stops:
        return {}
    if encode is None:
        raise RequestError(path, "stop strings need the model's tokenizer; this model has none")
    window = max(max(len(encode(s)), len(s)) for s in stops) + 1
    return {"stop": tuple(stops), "stop_window": window}


def _stop_patterns(
    value: Any, path: str, encode: Callable[[str], list[int]] | None
) -> dict[str, Any]:
    """``stop_regex`` and the tokens to decode to look for it, from ``sampling_params.stop_regex``
    (null or [] means none)."""
    try:
        patterns, longest = parse_stop_regex(value)
    except ValueError as exc:
        raise RequestError(path, str(exc)) from None
    if not patterns:
        return {}
    if encode is None:
        raise RequestError(path, "stop_regex needs the model's tokenizer; this model has none")
    return {"stop_regex": patterns, "stop_regex_window": longest + 1}


OVERRIDES = "positional_embed_overrides"  # SGLang's GenerateReqInput field


POSITIONS = "__inflight_position_ids"  # /v1/score's under --enable-mis: PromptPositions


def _prompt_positions(
    value: Any, prompts: list[list[int]], params: list[Any]
) -> list[PromptPositions | None]:
    """Each prompt's position ids (``POSITIONS``: one ``PromptPositions`` or None per prompt, as
    a route of this process hands them over; any other value, which a JSON body could hold, is
    an unknown key, without effect), checked against the prompt: prefill-only prompts only."""
    if not (
        isinstance(value, list)
        and len(value) == len(prompts)
        and all(v is None or isinstance(v, PromptPositions) for v in value)
    ):
        return [None] * len(prompts)
    for i, (ids, given) in enumerate(zip(prompts, value, strict=True)):
        if given is None:
            continue
        if len(given.ids) != len(ids) or (params[i] or {}).get("max_new_tokens") != 0:
            raise RequestError(f"{POSITIONS}[{i}]", "expected a position per prompt token")
    return list(value)


def _in_process_overrides(value: Any) -> bool:
    """Whether ``value`` is embedding overrides a route of this process made: one
    ``PositionalEmbeds`` or a list of them or None, one per prompt."""
    if isinstance(value, PositionalEmbeds):
        return True
    return (
        isinstance(value, list)
        and bool(value)
        and all(v is None or isinstance(v, PositionalEmbeds) for v in value)
    )


def _embed_overrides(
    value: Any, prompts: list[list[int]], width: int | None
) -> list[PositionalEmbeds | None]:
    """Each prompt's embedding overrides (``positional_embed_overrides``, as a route of this
    process hands them over: SGLang's ``_get_positional_embed_overrides_item``, one for all or
    one per prompt), checked against the prompt and the model's embedding width."""
    if value is None or not _in_process_overrides(value):
        return [None] * len(prompts)
    each = [value] * len(prompts) if isinstance(value, PositionalEmbeds) else value
    if len(each) != len(prompts):
        raise RequestError(OVERRIDES, f"expected {len(prompts)} entries, got {len(each)}")
    for i, (ids, over) in enumerate(zip(prompts, each, strict=True)):
        if over is None:
            continue
        rows = over.rows
        if width is None or rows.dim() != 2 or rows.shape[1] != width:
            raise RequestError(f"{OVERRIDES}[{i}]", f"expected rows of width {width}")
        if len(over.positions) != rows.shape[0] or any(
            not 0 <= p < len(ids) for p in over.positions
        ):
            raise RequestError(f"{OVERRIDES}[{i}]", "expected one row per position of the prompt")
    return list(each)


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if isinstance(value, list) and not value:
        return () in neutral or None in neutral
    return any(value is n or (type(value) is type(n) and value == n) for n in neutral)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )
