"""SGLang's tokenizer routes on the built-in engine: ``POST /v1/tokenize`` (also ``/tokenize``)
and ``POST /v1/detokenize`` (also ``/detokenize``).

Field names, defaults and answers follow SGLang 0.5.23 (``srt/entrypoints/openai/protocol.py``:
``TokenizeRequest``, ``TokenizeResponse``, ``DetokenizeRequest``, ``DetokenizeResponse``;
``serving_tokenize.py``):

- tokenize: exactly one of ``prompt`` and ``messages``. ``prompt`` a string (the answer's
  ``tokens`` its ids, ``count`` their number) or a list of strings (a list of each), encoded
  with ``add_special_tokens`` (default true). ``max_model_len``: the tokenizer's
  ``model_max_length``, unless that is no 64-bit integer (transformers' "no limit"), then the
  model's context length;
- ``messages`` are rendered by the chat route's own code (``openai_chat.chat_request`` on the
  same body: its checks, ``tools`` and ``tool_choice``, ``chat_template_kwargs``,
  ``reasoning_effort``, ``continue_final_message``), so their ids are the prompt a
  ``/v1/chat/completions`` request with those fields generates from; ``add_special_tokens``
  does not apply (the template writes its own). Unless ``add_generation_prompt`` is given: the
  template then gets that flag, and the text is encoded with special tokens only when the
  request sets ``add_special_tokens: true``; ``continue_final_message`` needs it true;
- detokenize: ``tokens`` a list of ids (the answer's ``text`` a string; none: ``""``) or of
  lists (a list of strings), decoded with ``skip_special_tokens`` (default true);
- ``model`` must be a string, and is not compared with the served model's name (nor is it
  there).

Refused with 400 and SGLang's ``{object: "error", message, type, param, code}``: both or neither
of ``prompt`` and ``messages``, a field of the wrong type, what the chat route refuses; and, where
SGLang answers empty text or a 500, an id outside the vocabulary (the model's or the
tokenizer's, whichever is larger). A model without a tokenizer gets a 400 naming the route.

Encoding and decoding run on the event loop, as ``/generate`` encodes its ``text``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from stages.engine.openai_api import (
    OpenAIError,
    checked_body,
    error_response,
    read_json,
    refusal,
)
from stages.engine.openai_chat import ChatSettings, chat_request
from stages.engine.request_body import dumps, is_int
from stages.engine.request_fields import checked_chat, checked_detokenize, checked_tokenize

if TYPE_CHECKING:
    from stages.engine.loader import LoadedModel

__all__ = ["TokenizeRoutes"]

_INT64_MIN, _UINT64_END = -(2**63), 2**64  # what SGLang's ORJSON answer can hold


class TokenizeRoutes:
    """The tokenizer routes of one engine: ``loaded``'s tokenizer (None: every request is
    refused), and ``chat`` (``openai_chat.ChatSettings``) to render ``messages`` with."""

    def __init__(self, loaded: LoadedModel, chat: ChatSettings | None) -> None:
        self.tokenizer = loaded.tokenizer
        self.chat = chat
        self.context_length = loaded.context_length
        self.vocab_size = loaded.vocab_size
        if self.tokenizer is not None:
            self.vocab_size = max(self.vocab_size, len(self.tokenizer))
        self.chat_with_special_tokens = None if chat is None else chat.shared_as(_WithSpecialTokens)

    def add_to(self, app: web.Application) -> None:
        for prefix in ("/v1", ""):
            app.router.add_post(prefix + "/tokenize", self.tokenize)
            app.router.add_post(prefix + "/detokenize", self.detokenize)

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._serve(request, self.tokenized)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._serve(request, self.detokenized)

    async def _serve(
        self, request: web.Request, answer: Callable[[Any], dict[str, Any]]
    ) -> web.Response:
        if self.tokenizer is None:
            return error_response(
                f"this model has no tokenizer, which {request.path} needs: give the model "
                "folder tokenizer files"
            )
        try:
            body = await read_json(request)
            return web.Response(body=dumps(answer(body)), content_type="application/json")
        except OpenAIError as exc:
            return web.json_response(refusal(exc), status=400)

    def tokenized(self, body: Any) -> dict[str, Any]:
        """SGLang's ``TokenizeResponse`` of a ``/v1/tokenize`` body; OpenAIError when refused."""
        body = checked_body(checked_tokenize, body)
        prompt, messages = body.get("prompt"), body.get("messages")
        listed = isinstance(prompt, list)
        limit = self._max_model_len()
        if messages is not None:
            ids = self._chat_ids(body)
            return {"tokens": ids, "count": len(ids), "max_model_len": limit}
        special = body.get("add_special_tokens", True)
        if listed:
            rows = [list(self.tokenizer.encode(p, add_special_tokens=special)) for p in prompt]
            return {"tokens": rows, "count": [len(r) for r in rows], "max_model_len": limit}
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=special))
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt ids the chat route makes of ``body``'s messages
        (``OpenAIServingTokenize._tokenize_chat_request``)."""
        skipped = ("prompt", "add_special_tokens", "add_generation_prompt")
        chat_body = {k: v for k, v in body.items() if k not in skipped}
        try:  # SGLang: to_chat_completion_request validates them as a chat request
            chat_body = checked_chat(chat_body)
        except ValueError as exc:  # its ValidationError, answered as the route's ValueErrors
            raise OpenAIError(str(exc)) from None
        settings = self.chat
        generation = body.get("add_generation_prompt")
        if generation is not None:  # the messages as given, the template told this flag
            if settings.encoding is not None:  # a chat encoding (dsv32, kimi_k3): SGLang's 400
                raise OpenAIError(
                    "add_generation_prompt is supported only with a Jinja chat template.",
                    "add_generation_prompt",
                )
            if body.get("continue_final_message") and not generation:
                raise OpenAIError(
                    "continue_final_message needs add_generation_prompt to open the "
                    "assistant turn.",
                    "add_generation_prompt",
                )
            kwargs = body.get("chat_template_kwargs")
            if isinstance(kwargs, dict) and "add_generation_prompt" in kwargs:
                raise OpenAIError(
                    "add_generation_prompt: given both as a field and in chat_template_kwargs",
                    "add_generation_prompt",
                )
            if body.get("add_special_tokens") is True:  # only when the request says so
                settings = self.chat_with_special_tokens
        native, _ = chat_request(
            chat_body, settings, self.context_length, add_generation_prompt=generation
        )
        return native["input_ids"]

    def _max_model_len(self) -> int:
        value = getattr(self.tokenizer, "model_max_length", None)
        if is_int(value) and _INT64_MIN <= value < _UINT64_END:
            return value
        return self.context_length

    def detokenized(self, body: Any) -> dict[str, Any]:
        """SGLang's ``DetokenizeResponse`` of a ``/v1/detokenize`` body; OpenAIError when
        refused."""
        body = checked_body(checked_detokenize, body)
        skip = body.get("skip_special_tokens", True)
        tokens, decode = body["tokens"], self.tokenizer.decode
        if all(is_int(t) for t in tokens):  # [] too: SGLang's first member takes it
            self._check_ids(tokens, "tokens")
            return {"text": decode(tokens, skip_special_tokens=skip)}
        for i, row in enumerate(tokens):
            self._check_ids(row, f"tokens[{i}]")
        return {"text": [decode(row, skip_special_tokens=skip) for row in tokens]}

    def _check_ids(self, ids: list[int], where: str) -> None:
        if not ids or (0 <= min(ids) and max(ids) < self.vocab_size):
            return
        for j, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise OpenAIError(
                    f"{where}[{j}]: token id {token} is outside the vocabulary "
                    f"[0, {self.vocab_size})",
                    "tokens",
                )


class _WithSpecialTokens(ChatSettings):
    """Chat settings whose rendered text is always encoded with the tokenizer's special
    tokens (``/v1/tokenize``'s ``add_generation_prompt`` with ``add_special_tokens: true``)."""

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        kwargs: dict,
        *,
        add_special_tokens: bool = True,
    ) -> list[int]:
        return super().render(messages, tools, kwargs, add_special_tokens=True)
