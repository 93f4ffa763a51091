"""Whether every request field of a built-in engine takes any JSON value without a 5xx.

Run (prints one JSON line; exit 1 when it finds a problem):

    python bench/engine_fuzz.py [--concurrency 8] [--engine-args "--reasoning-parser qwen3 ..."]

``inflight engine`` (as users start it) on arith-tiny, with a pass-through chat template, the
``qwen3`` reasoning parser, the ``qwen25`` tool-call parser and ``--enable-lora`` (and
``--engine-args``), gets one request for every field of every generating route and every value
of a spread of JSON values (``VALUES``: scalars at and past their edges, ``NaN`` and
``Infinity``, integers past 64 bits, containers of them, and the shapes the routes' structured
fields take), each put on a body the route would otherwise serve, streamed and not (a
stream's events read whole):

- ``/generate``: its top-level fields and every ``sampling_params`` key, and each value as
  the ``custom_params`` of three of SGLang's shipped custom logit processors (which run with
  ``--engine-args=--enable-custom-logit-processor``: ``custom_logit_processor_failures``
  counts the samples a processor failed on, each aborted);
- ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages`` (and
  ``count_tokens``), ``/v1/tokenize``, ``/v1/detokenize``, ``/v1/score``, Ollama's
  ``/api/chat`` and ``/api/generate``: every field of SGLang 0.5.23's request model
  (``stages.engine.request_fields``);
- the native routes that cannot change what the engine serves next (``/abort_request``,
  ``/update_weight_version``, ``/get_weights_by_name``, ``/unload_lora_adapter``,
  ``/parse_function_call``, ``/separate_reasoning``, ``/open_session``, ``/close_session``,
  ``/close_sessions`` (Inflight's), ``/set_internal_state``, ``/update_weights_from_ipc``, and
  the remote-instance routes on bodies that make no group): every field of their ``io_struct``
  request (``stages.engine.control_fields``), not streamed;
- the routes of features the engine lacks (``/add_external_corpus``,
  ``/remove_external_corpus``, ``PUT /hicache/storage-backend``, ``/pd_role_switch``:
  ``stages.engine.feature_off_routes``), every field of their request.

``--only ROUTE`` (repeatable) sends only the requests of those routes: a short fuzz.

A problem is an answer with a 5xx status (but SGLang's own 500 for a parser name it does not
know on ``/parse_function_call`` and ``/separate_reasoning``), a request that times out or
loses its connection, a stream of ``/generate``, ``/v1/completions`` or the chat route not
ending with ``[DONE]``, a traceback in the engine's log, or the engine not serving a plain
request and ``/health_generate`` afterwards. Reported: the statuses by route, the problems
(route, field, status: how many, and the first value), the engine's refusals as it counted
them. What a value
should get (a 400 in SGLang's words, or an answer) is for the tests; this finds what no test
thought to send. Its first run found ``/v1/responses`` answering 500 when its echoed
``metadata`` held an integer past 64 bits (orjson cannot write one); run on the code before
that session, it finds the scheduler's step failing on a ``top_k`` of 2**63 (a traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import aiohttp  # noqa: E402

from bench._engines import engine_server  # noqa: E402
from stages.engine import (  # noqa: E402
    control_fields,
    custom_logits,
    feature_off_routes,
    openai_decisions,
    request_fields,
)
from tests.stages.tiny_model import make_tiny_moe_model  # noqa: E402
from tests.stages.tiny_vlm import make_qwen_vl  # noqa: E402

ARITH = ROOT / "configs" / "models" / "arith-tiny"
PASS_THROUGH = "{% for m in messages %}{{ m.content }}{% endfor %}"

_SCALARS = [
    None, True, False, 0, 1, -1, 2, 0.5, 2.5, -0.0, 300, 10**6, -(10**6), 2**31, 2**63,
    -(2**63) - 1, 2**70, -(2**70), 1e20, float("nan"), float("inf"), -float("inf"),
    "", "x", "0", "1", "2.0", " 1", "1e3", "nan", "inf", "yes", "TRUE", "auto", "none",
    "required", "last", "low", "high", "json", "5m", "<|im_end|>", "</think>", "\u00e9\U0001f600",
]  # fmt: skip
_SHAPES = [
    {"role": "user", "content": "1+1="}, {"role": "user"}, {"role": 1, "content": "x"},
    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
     "arguments": "{}"}}]},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": None}}, {"function": {}},
    {"type": "json_object"}, {"type": "text", "text": "x"}, {"type": "image_url"},
    {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
    {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "bogus"}}},
    {"include_usage": True, "continuous_usage_stats": True}, {"include_usage": "yes"},
    {"effort": "none"}, {"effort": 1, "summary": "long"}, {"num_predict": 2, "temperature": 0},
]  # fmt: skip
# an image and what its fields may hold on a vision model (--vision): the first is the image
# that --vision's prompts carry (a 56x56 PNG), then its forms, broken ones and other files
_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAADgAAAA4CAIAAAAn5KxJAAAARUlEQVR42u3OQREAAAQAMATRP4pYUni42xIspzs+"
    "qHhCVFRUVFRUVFRUVFRUVFRUVFRUVFRUVFRUVFRUVFRUVFRUVPTaAshdAXSD19j/AAAAAElFTkSuQmCC"
)
IMAGE_VALUES: list[Any] = [
    "data:image/png;base64," + _PNG, _PNG, {"url": "data:image/png;base64," + _PNG},
    "data:image/png;base64," + _PNG[:60], "data:image/png;base64,", "data:", "data:,x",
    "data:image/png;base64,!!!", _PNG[:60], "/nonexistent.png", "file:///nonexistent.png",
    "/etc/hostname", "x.png", "http://127.0.0.1:9/x.png", {"url": None}, {"url": 1}, {},
    [["data:image/png;base64," + _PNG]], ["data:image/png;base64," + _PNG] * 2,
]  # fmt: skip
IMAGE_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>1+1=<|im_end|>\n"
VALUES: list[Any] = [
    *_SCALARS,
    *_SHAPES,
    [],
    {},
    *([value] for value in _SCALARS[:24]),  # a list of each (ids, stop strings, tokens...)
    *({"5": value} for value in _SCALARS[:24]),  # an object of each (logit_bias, kwargs...)
    *([shape] for shape in _SHAPES),
    [[5, 6], [7]],
    [[]],
    [5, "x"],
    [[["x"]]],
]
_GENERATE = (
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "lora_path",
    "return_hidden_states", "return_prompt_token_ids", "extra_key", "cache_salt", "priority",
    "require_reasoning", "return_sampling_mask", "sampling_logprobs_mode", "watermark",
    "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "max_thinking_tokens",
    "data_parallel_rank", "bootstrap_host", "session_params", "custom_logit_processor",
    "return_routed_experts", "routed_experts_start_len", "session_id", "background",
    "input_embeds",
)  # fmt: skip
_SAMPLING = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "no_stop_trim", "stop_regex", "json_schema", "regex",
    "ebnf", "structural_tag", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "logit_bias", "sampling_seed", "stream_interval", "beam_width",
    "spaces_between_special_tokens", "custom_params",
)  # fmt: skip
_MESSAGES = [{"role": "user", "content": "1+1="}]
_ROUTES = [  # (path, SGLang's request model's fields, a body the route serves)
    ("/v1/completions", request_fields.CompletionFields,
     {"model": "m", "prompt": "1+1=", "max_tokens": 3}),
    ("/v1/chat/completions", request_fields.ChatFields,
     {"model": "m", "messages": _MESSAGES, "max_tokens": 3}),
    ("/v1/tokenize", request_fields.TokenizeFields, {"model": "m", "prompt": "1+1="}),
    ("/v1/detokenize", request_fields.DetokenizeFields, {"model": "m", "tokens": [5]}),
    ("/v1/responses", request_fields.ResponsesFields,
     {"model": None, "input": "1+1=", "max_output_tokens": 3}),  # None: the served name
    ("/v1/score", request_fields.ScoreFields,
     {"model": "m", "query": "1+", "items": ["1"], "label_token_ids": [5]}),
    ("/v1/messages", request_fields.MessagesFields,
     {"model": "m", "messages": _MESSAGES, "max_tokens": 3}),
    ("/v1/messages/count_tokens", request_fields.CountTokensFields,
     {"model": "m", "messages": _MESSAGES}),
    ("/v1/decisions", openai_decisions.DecisionRequest,
     {"model": "m", "input": "1+1=2", "questions": [{"id": "q", "type": "score",
                                                    "question": "right?", "levels": ["0", "1"]}]}),
    ("/api/chat", request_fields.OllamaChatFields,
     {"model": "m", "messages": _MESSAGES, "stream": False, "options": {"num_predict": 3}}),
    ("/api/generate", request_fields.OllamaGenerateFields,
     {"model": "m", "prompt": "1+1=", "stream": False, "options": {"num_predict": 3}}),
]  # fmt: skip


# the native routes whose bodies cannot change what the engine serves next (no pause, memory
# release, slow-down, weight load or profile): every field of their io_struct request
_CONTROL = [
    ("/abort_request", control_fields.AbortFields, {"rid": "no-such-request"}),
    ("/update_weight_version", control_fields.UpdateVersionFields,
     {"new_version": "fuzz", "abort_all_requests": False}),
    ("/get_weights_by_name", control_fields.WeightsByNameFields,
     {"name": "model.embed_tokens.weight", "truncate_size": 2}),
    ("/unload_lora_adapter", control_fields.UnloadLoraFields, {"lora_name": "none-such"}),
    ("/parse_function_call", control_fields.ParseFunctionCallFields,
     {"text": "x", "tool_call_parser": "qwen25", "tools": []}),
    ("/separate_reasoning", control_fields.SeparateReasoningFields,
     {"text": "<think>a</think>b", "reasoning_parser": "qwen3"}),
    ("/open_session", control_fields.OpenSessionFields, {"capacity_of_str_len": 100}),
    ("/close_session", control_fields.CloseSessionFields, {"session_id": "none-such"}),
    ("/close_sessions", control_fields.CloseSessionsFields, {"session_ids": ["none-such"]}),
    ("/set_internal_state", control_fields.SetInternalStateFields, {"server_args": {}}),
    ("/update_weights_from_ipc", control_fields.UpdateIpcFields,
     {"zmq_handles": {"GPU-0": "ipc:///tmp/none.sock"}}),
    # two fields refuse the base body (a rank that would receive, ports that are none), so
    # changing one field never makes a group a peer would have to join
    ("/init_weights_send_group_for_remote_instance", control_fields.InitSendGroupFields,
     {"master_address": "127.0.0.1", "ports": "x", "group_rank": 1, "world_size": 2}),
    ("/send_weights_to_remote_instance", control_fields.SendWeightsFields,
     {"master_address": "127.0.0.1", "ports": "1", "group_name": "none-such"}),
    ("/add_external_corpus", feature_off_routes.AddCorpusFields, {"documents": ["1+1=2"]}),
    ("/remove_external_corpus", feature_off_routes.RemoveCorpusFields, {"corpus_id": "c"}),
    ("/hicache/storage-backend", feature_off_routes.AttachHiCacheFields,
     {"hicache_storage_backend": "file"}),
    ("/pd_role_switch", feature_off_routes.PdRoleSwitchFields, {"new_role": "decode"}),
]  # fmt: skip
_METHODS = {"/hicache/storage-backend": "PUT"}  # the rest: POST


# where SGLang answers 500 itself: a parser name it does not know (its parser classes raise a
# ValueError its route lets out; stages/engine/parse_routes.py)
_SGLANG_500 = {
    ("/parse_function_call", "tool_call_parser"),
    ("/separate_reasoning", "reasoning_parser"),
}


def requests_to_send(
    model: str, routed: bool = False, vision: bool = False
) -> list[tuple[str, str, Any, dict[str, Any]]]:
    """``(path, field, value, body)`` for every field of every route and every value, each
    once on a body not streamed and once on a streamed one (where the route streams);
    ``routed``: every generating body asks for its routed experts; ``vision``: the prompts
    of ``/generate`` and the chat route have an image, and its fields get the image forms
    of ``IMAGE_VALUES`` too."""
    out = []
    asks = {"return_routed_experts": True} if routed else {}
    for stream in (False, True):
        plain = {"text": "1+1=", "sampling_params": {"max_new_tokens": 3}, "stream": stream}
        plain.update(asks)
        if vision:
            plain.update(text=IMAGE_PROMPT, image_data=IMAGE_VALUES[0])
            for value in [*VALUES, *IMAGE_VALUES]:
                out.append(("/generate", "image_data", value, {**plain, "image_data": value}))
                out.append(("/generate", "image_data[0]", value, {**plain, "image_data": [value]}))
                part = {"type": "image_url", "image_url": {"url": value}}
                chat = {"model": model, "max_tokens": 3, "stream": stream,
                        "messages": [{"role": "user", "content": [part]}]}  # fmt: skip
                out.append(("/v1/chat/completions", "image_url.url", value, chat))
                part = {"type": "image_url", "image_url": value}
                chat = {**chat, "messages": [{"role": "user", "content": [part]}]}
                out.append(("/v1/chat/completions", "image_url", value, chat))
        for value in VALUES:
            for field in _GENERATE:
                out.append(("/generate", field, value, {**plain, field: value}))
            # as the prompt (SGLang's refusal, or with --disable-radix-cache the embeddings)
            alone = {key: item for key, item in plain.items() if key != "text"}
            out.append(("/generate", "input_embeds as the prompt", value,
                        {**alone, "input_embeds": value}))  # fmt: skip
            for key in _SAMPLING:
                params = {"max_new_tokens": 3, key: value}
                out.append(("/generate", f"sampling_params.{key}", value, {**plain,
                            "sampling_params": params}))  # fmt: skip
            for name, text in _PROCESSORS.items():  # what a processor does with any params
                params = {"max_new_tokens": 3, "custom_params": value}
                body = {**plain, "sampling_params": params, "custom_logit_processor": text}
                out.append(("/generate", f"custom_params for {name}", value, body))
            for path, fields, base in _ROUTES:
                if stream and path in _NOT_STREAMED:
                    continue
                body = {**base, "model": base["model"] or model}
                if path in ("/v1/completions", "/v1/chat/completions"):
                    body.update(asks)
                if path not in _NOT_STREAMED:
                    body["stream"] = stream
                for field in fields.__annotations__:
                    out.append((path, field, value, {**body, field: value}))
    for value in VALUES:
        for path, fields, base in _CONTROL:
            for field in fields.__annotations__:
                out.append((path, field, value, {**base, field: value}))
    return out


# SGLang's shipped processors, sent with every value as their custom_params (with
# --enable-custom-logit-processor they run: one that fails aborts its request; without, 400s)
_PROCESSORS = {
    cls.__name__: cls.to_str()
    for cls in (
        custom_logits.DisallowedTokensLogitsProcessor,
        custom_logits.Qwen3ThinkingBudgetLogitProcessor,
        custom_logits.DeepseekOCRNoRepeatNGramLogitProcessor,
    )
}
_DONE = ("/generate", "/v1/completions", "/v1/chat/completions")  # streams that end so
_NOT_STREAMED = ("/v1/tokenize", "/v1/detokenize", "/v1/score", "/v1/messages/count_tokens",
                 "/v1/decisions")  # fmt: skip


async def _fuzz(url: str, args: argparse.Namespace) -> dict[str, Any]:
    statuses: collections.Counter[str] = collections.Counter()
    problems: dict[str, dict[str, Any]] = {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        todo = requests_to_send(model, args.moe, args.vision)
        if args.only:
            todo = [request for request in todo if request[0] in args.only]
        gate = asyncio.Semaphore(args.concurrency)

        async def send(path: str, field: str, value: Any, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()  # NaN and Infinity as Python writes them
            answer, streamed = b"", False
            async with gate:
                try:
                    async with s.request(
                        _METHODS.get(path, "POST"), url + path, data=data,
                        headers={"Content-Type": "application/json"},
                    ) as r:  # fmt: skip
                        answer = await r.read()
                        status: int | str = r.status
                        streamed = r.headers.get("Content-Type", "").startswith("text/event")
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    status = type(exc).__name__
            done = answer.endswith(b"data: [DONE]\n\n") if status == 200 else True
            if streamed and path in _DONE and not done:
                status = "stream without [DONE]"
            statuses[f"{path} {status}"] += 1
            if isinstance(status, str) or (status >= 500 and (path, field) not in _SGLANG_500):
                found = problems.setdefault(f"{path} {field} {status}", {"count": 0})
                found["count"] += 1
                found.setdefault("first", repr(value)[:120])

        await asyncio.gather(*(send(*request) for request in todo))
        # ids, so that an engine without a tokenizer (--skip-tokenizer-init) is asked too
        plain = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}
        async with s.post(url + "/generate", json=plain) as r:
            if r.status != 200:
                problems["after"] = {"count": 1, "first": f"/generate {r.status}"}
        async with s.get(url + "/health_generate") as r:
            if r.status != 200:
                problems["after health"] = {"count": 1, "first": f"{r.status}"}
        async with s.get(url + "/server_info") as r:
            info = await r.json()
    return {"requests": len(todo), "answers": dict(sorted(statuses.items())),
            "problems": problems, "refused_requests": info["refused_requests"],
            # samples aborted because a processor failed on what it was given (with the flag)
            "custom_logit_processor_failures": info["custom_logit_processor_failures"]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=30, help="seconds a request")
    parser.add_argument("--engine-args", default="", help="more flags for the engine")
    parser.add_argument(
        "--moe",
        action="store_true",
        help="a tiny mixture-of-experts model (arith-tiny's tokenizer) with "
        "--enable-return-routed-experts, every generating body asking for them",
    )
    parser.add_argument(
        "--vision",
        action="store_true",
        help="a tiny Qwen2.5-VL with its own chat template: image prompts, and their fields "
        "given every value and image form",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="ROUTE",
        help="send only this route's requests (repeatable; default: every route)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        template, log = Path(tmp) / "chat.jinja", Path(tmp) / "engine.log"
        template.write_text(PASS_THROUGH)
        flags = ["--chat-template", str(template), "--reasoning-parser", "qwen3",
                 "--tool-call-parser", "qwen25", "--enable-lora",
                 *shlex.split(args.engine_args)]  # fmt: skip
        model = ARITH
        if args.vision:  # the model's own template, which renders image parts
            model = make_qwen_vl(Path(tmp) / "vl")
            flags = flags[2:]
        if args.moe:
            model = make_tiny_moe_model(Path(tmp) / "moe", tokenizer_from=ARITH)
            flags.append("--enable-return-routed-experts")
        start = time.perf_counter()
        with (
            open(log, "wb") as output,
            engine_server(model, *flags, env={"OMP_NUM_THREADS": "1"}, output=output) as (url, _),
        ):
            result = asyncio.run(_fuzz(url, args))
        seconds = time.perf_counter() - start
        text = log.read_text(errors="replace")
    head = {"bench": "engine_fuzz", "engine_args": args.engine_args, "moe": args.moe,
            "vision": args.vision,
            "seconds": round(seconds, 1)}  # fmt: skip
    return report(head, result, text)


def report(head: dict[str, Any], result: dict[str, Any], log_text: str) -> int:
    """Print a fuzz's JSON line (``head``, then ``result``, a traceback in the engine's log
    ``log_text`` counted among its problems); its exit status: 1 when it found a problem."""
    if "Traceback" in log_text:
        at = log_text.index("Traceback")
        result["problems"]["engine log"] = {"count": log_text.count("Traceback"),
                                            "first": log_text[at : at + 2000]}  # fmt: skip
    print(json.dumps({**head, "ok": not result["problems"], **result}))
    return 0 if not result["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
