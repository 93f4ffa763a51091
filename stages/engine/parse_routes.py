"""SGLang's parser utility routes on the built-in engine: ``POST /parse_function_call`` reads
the tool calls out of a text, ``POST /separate_reasoning`` splits a text into its reasoning and
its content. Nothing is generated; the text is read by the parsers the chat route reads answers
with (``tool_calls``, ``tool_formats``, ``pythonic_calls``; ``reasoning``).

As SGLang 0.5.23 answers them (``srt/entrypoints/http_server.py``
``parse_function_call_request``, ``separate_reasoning_request``; bodies ``io_struct``
``ParseFunctionCallReq``, ``SeparateReasoningReqInput``):

- ``/parse_function_call``: ``text``, ``tools`` (OpenAI tool objects, default none),
  ``tool_call_parser`` (a ``--tool-call-parser`` name, case as written) ->
  ``{normal_text, calls: [{tool_index, name, parameters}]}``, ``parameters`` the arguments as
  JSON text. As ``FunctionCallParser.parse_non_stream``: no tools, the text as it is and no
  calls; else a text without the format's marker is left as it is; calls naming no tool are
  dropped. ``tool_index`` is the named tool's place in ``tools`` (the last with that name), or
  for ``pythonic`` the call's place in its list, the calls dropped counted;
- ``/separate_reasoning``: ``text``, ``reasoning_parser`` (a ``--reasoning-parser`` name, any
  case), ``return_blocks`` (false) -> ``{reasoning_text, text}``, and with ``return_blocks``
  ``reasoning_blocks``, ``text_blocks`` and ``blocks`` (``[{type: "reasoning", text}]`` when
  there is reasoning, then ``{type: "text", text}``). The request is not a chat request, so no
  thinking switch applies: the parser's own default decides whether a text without its start
  tag is reasoning (the ``deepseek-r1`` family, ``qwen3-thinking``, ``minimax``, ``k2_horizon``
  in its ``high`` tags, ``kimi_k3``: yes; the rest: no; ``minimax-append-think`` splits
  nothing: the text is content, ``<think>`` before it).

Refusals, as SGLang's: a body that is not a JSON object or a field of the wrong type (``tools``
as ``io_struct.Tool``: ``function`` an object with string-or-null ``name`` and ``description``,
object-or-null ``parameters``) is a 400 ``{object: "error", message, type: "Bad Request", param:
null, code: 400}`` (its ``RequestValidationError`` answer); ``return_blocks`` is read as pydantic
reads a bool (``1``, ``"yes"``, ``"off"`` ...). A parser whose output SGLang reads with its
model's own tokenizer (``deepseek-v4`` and the like, ``native_text_parser``) is a 400 of type
``"400"`` with SGLang's message, as is a format SGLang reads and this engine does not (saying
so). A name SGLang does not know (also an empty one, and a ``tool_call_parser`` left out or
null) is a 500 ``Internal Server Error`` (text), as SGLang's parser classes raise ``ValueError``
there and its route lets it out; logged (the 1st, 2nd, 4th ... of each route), as the refusal
counter counts only 4xx.

Checked against SGLang's own ``FunctionCallParser`` and ``ReasoningParser`` on 20,000 random
texts per route (a local check, not in the suite): every reasoning answer agrees, and every
tool-call answer but where SGLang's parser raises, on a value that should be a call and is not
a JSON object, or whose name is a list or an object (``llama3``, ``mistral``,
``qwen25``/``qwen``; ``parse_base_json``): SGLang answers 500 there, this route the text as it
is, no calls (what SGLang's chat route answers).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import structlog
from aiohttp import web

from stages.engine.apertus_reasoning import ApertusReasoning
from stages.engine.control_fields import PARSE_FUNCTION_CALL, SEPARATE_REASONING, typed_body
from stages.engine.reasoning import PARSERS as REASONING_PARSERS
from stages.engine.reasoning import ThinkFormat, served_format, think_parser
from stages.engine.request_body import invalid, json_response
from stages.engine.tool_calls import PARSERS as TOOL_CALL_PARSERS
from stages.engine.tool_calls import PARSES_WITHOUT_TOOLS, ToolCallParser
from transport.credit import sparse

__all__ = ["ParseRoutes"]

log = structlog.get_logger("stages.engine.parse_routes")

# SGLang 0.5.23's names (function_call/parser_names.py, parser/reasoning_parser_names.py)
SGLANG_TOOL_CALL_PARSERS = (
    "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32",
    "deepseekv4", "deepseekv41", "dots", "glm", "glm45", "glm47", "gpt-oss", "k2_horizon",
    "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3", "mimo", "minicpm5", "mistral", "muse",
    "poolside_v1", "pythonic", "qwen", "qwen25", "qwen3_coder", "spark25", "step3", "step3p5",
    "minimax-m2", "minimax-m3", "nanbeige", "trinity", "interns1", "hermes", "hunyuan",
    "gigachat3", "gigachat35", "gemma4", "inkling", "iquest_q1", "response_template",
)  # fmt: skip
SGLANG_REASONING_PARSERS = (
    "apertus2509", "beam", "deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41", "dots",
    "glm45", "ling3", "hunyuan", "gpt-oss", "k2_horizon", "kimi", "kimi_k2", "kimi_k3", "mimo",
    "muse", "poolside_v1", "qwen3", "qwen3-thinking", "minimax", "minimax-append-think",
    "minimax-m3", "nanbeige", "step3", "step3p5", "mistral", "nemotron_3",
    "granite_thinking_parser", "interns1", "gemma4", "inkling", "iquest_q1", "cohere_command4",
    "gigachat35", "response_template",
)  # fmt: skip
# names whose output SGLang parses with its model's own chat-encoding adapter, on either route
# (chat_encoding_adapters.ADAPTER_OUTPUT_PARSERS): never served here
_ADAPTER_PARSERS = ("deepseek-v4", "deepseekv4", "deepseek-v41", "deepseekv41")


# io_struct.Function's fields, each optional, as pydantic names what they should be
class ParseRoutes:
    """``/parse_function_call`` and ``/separate_reasoning``; they need nothing of the model but
    its ``tokenizer``, whose vocabulary spells ``hunyuan``'s tokens (SGLang passes it to both
    parsers; none: the bare tags)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.unknown: Counter[str] = Counter()  # by route: 500s for names SGLang does not know
        self.tokenizer = tokenizer

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/parse_function_call", self.parse_function_call)
        app.router.add_post("/separate_reasoning", self.separate_reasoning)

    async def parse_function_call(self, request: web.Request) -> web.Response:
        body = await typed_body(request, PARSE_FUNCTION_CALL)
        if isinstance(body, web.Response):
            return body
        text, parser = body["text"], body.get("tool_call_parser")
        names = [tool["function"].get("name") for tool in body.get("tools", [])]
        if parser not in TOOL_CALL_PARSERS:
            known = parser in SGLANG_TOOL_CALL_PARSERS
            return self._unread(request, parser, known, "tool calls", TOOL_CALL_PARSERS)
        content, calls = _read_calls(text, names, parser, body.get("tools", []), self.tokenizer)
        return json_response({"normal_text": content, "calls": calls})

    async def separate_reasoning(self, request: web.Request) -> web.Response:
        body = await typed_body(request, SEPARATE_REASONING)
        if isinstance(body, web.Response):
            return body
        text, name = body["text"], body["reasoning_parser"]
        blocks = body.get("return_blocks", False)
        fmt = REASONING_PARSERS.get(name.lower())
        if fmt is None:
            known = name.lower() in SGLANG_REASONING_PARSERS
            return self._unread(request, name, known, "reasoning", tuple(REASONING_PARSERS))
        return json_response(_separated(text, served_format(fmt, self.tokenizer), blocks))

    def _unread(
        self, request: web.Request, name: str | None, known: bool, what: str, served: tuple
    ) -> web.Response:
        """The answer for a parser this engine does not read: SGLang's 400 for a model-specific
        one, a 400 saying so for another format SGLang reads, else SGLang's 500."""
        if name in _ADAPTER_PARSERS:
            return invalid(
                f"{name!r} output is parsed with its model's tokenizer; this server does not "
                "serve that model",
                "400",
            )
        if known:
            return invalid(
                f"the built-in engine does not read {what} in the {name!r} format: it reads "
                f"{', '.join(served)}",
                "400",
            )
        self.unknown[request.path] += 1
        if sparse(count := self.unknown[request.path]):
            log.warning("parser_unknown", route=request.path, parser=str(name)[:100], count=count)
        return web.Response(status=500, text="Internal Server Error")


def _read_calls(
    text: str,
    names: list[str | None],
    parser: str,
    tools: list[dict[str, Any]],
    tokenizer: Any = None,
) -> tuple[str, list[dict[str, Any]]]:
    """``(normal_text, calls)`` as ``FunctionCallParser.parse_non_stream`` gives them
    (``tools``: the checked tools, whose parameters type ``qwen3_coder``'s values)."""
    if not names and parser not in PARSES_WITHOUT_TOOLS:
        return text, []
    where = {name: i for i, name in enumerate(names) if name}  # the last of a name wins
    if parser not in PARSES_WITHOUT_TOOLS:  # (whose reader tells no tools from unnamed ones)
        tools = [t for t in tools if t["function"].get("name")]
    reader = ToolCallParser(tools, parser, tokenizer)
    if not reader.has_tool_call(text):
        return text, []
    content, calls = reader.indexed(text, where)
    return content, [
        {"tool_index": index, "name": call["name"], "parameters": call["arguments"]}
        for index, call in calls
    ]


def _separated(text: str, fmt: ThinkFormat, blocks: bool) -> dict[str, Any]:
    """``/separate_reasoning``'s answer: the parser starts as its detector does by default,
    there being no chat request (``ReasoningParser`` with the HTTP request as ``request``)."""
    parser = think_parser(fmt, force=fmt.force_unset)
    reasoning, content = parser.parse(text)
    answer: dict[str, Any] = {"reasoning_text": reasoning, "text": content}
    if blocks:  # parse_non_stream_blocks: the detector's own sequence (Apertus's), else a
        # reasoning block when there is reasoning, and the text
        if isinstance(parser, ApertusReasoning):
            parts = [{"type": kind, "text": part} for kind, part in parser.blocks(text)]
        else:
            parts = [{"type": "reasoning", "text": reasoning}] if reasoning else []
            parts.append({"type": "text", "text": content})
        answer["reasoning_blocks"] = [p["text"] for p in parts if p["type"] == "reasoning"]
        answer["text_blocks"] = [p["text"] for p in parts if p["type"] == "text"]
        answer["blocks"] = parts
    return answer
