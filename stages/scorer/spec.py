"""One entry of a scorer's ``rewards`` list (and of the learner's ``eval.rewards``): a reward
function (``fn``), a reward server (``url``) or a generative judge served by an engine
(``judge``), each with its weight in the summed reward.

Only the config and its checks live here, so that a mistake (an unknown function, a URL that is
not http(s), a judge's ``parse`` without exactly one group, options that do not apply) is a
config error at ``inflight validate``, at its key's line. What runs them: ``runner.py``
(functions, and the calls of the others) and ``remote.py`` (servers and judges).
"""

from __future__ import annotations

import dataclasses
import re
import string
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from stages.generator.launcher import LaunchConfig
from stages.workers import resolve_function

__all__ = [
    "JudgeSpec",
    "RewardModelSpec",
    "RewardSpec",
    "check_headers",
    "check_one_engine",
    "http_option",
    "http_url",
]

# the options of calls behind HTTP (``url`` and ``judge`` rewards, the distillation teacher):
# default, what it does, checks
_HTTP = {
    "timeout_s": (60.0, "limit on one HTTP call", {"min": 0.001}),
    "retries": (
        3,
        "more tries of a call after a connection error, a time-out, or HTTP 5xx or 429 (never "
        "after another 4xx)",
        {"min": 0},
    ),
    "backoff_s": (0.5, "wait before the first retry, doubled each time", {"min": 0.0}),
    "concurrency": (8, "most calls in flight to the server", {"min": 1}),
    "batch_size": (
        None,
        "most samples in one call (default: all of a scoring call's samples, up to the "
        "scorer's batch_groups groups)",
        {"min": 1},
    ),
    "headers": ({}, "HTTP headers sent with every call (Authorization...)", {}),
}
_HTTP_OPTIONS = tuple(_HTTP)


def _f(default: Any, doc: str, **meta: Any) -> Any:
    return field(default=default, metadata={"doc": doc, **meta})


def http_option(name: str, applies: str = "") -> Any:
    """The dataclass field of the HTTP option ``name``, its doc after ``applies``."""
    default, doc, meta = _HTTP[name]
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"doc": f"{applies}{doc}", **meta})
    return _f(default, f"{applies}{doc}", **meta)


def check_headers(headers: dict[str, str]) -> None:
    """A ValueError naming the first of ``headers`` that is not a header."""
    for key, value in headers.items():
        if not key or any(c in f"{key}{value}" for c in "\r\n"):
            raise ValueError(f"headers: {key!r} is not a header (empty, or a line break)")


def http_url(url: str, key: str) -> str:
    """``url`` when it is an http(s) URL with a host; ValueError naming ``key`` otherwise."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number)
    except ValueError as exc:
        raise ValueError(f"{key} {url!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{key} {url!r} must be an http:// or https:// URL with a host")
    return url


def check_one_engine(launch: LaunchConfig, whose: str) -> None:
    """A ValueError unless ``launch`` (a ``LaunchConfig``) starts one engine of a model in a
    process of its own, outside the placement's plan: what a scorer starts for itself."""
    if not launch.model:
        raise ValueError(f"launch.model is required: {whose} model folder or Hub id")
    if launch.count != 1 or launch.in_process:
        raise ValueError(
            "launch: the scorer starts one engine in a process of its own (count 1, in_process "
            "false); for more, start them yourself behind one url"
        )
    if launch.resources.cpus is not None or launch.resources.gpus:
        raise ValueError(
            "launch.resources: the placement plans the generators' engines only, not the "
            "scorer's; give its device in launch.device and start it where it has room"
        )


def _template_fields(template: str) -> list[str]:
    """The names ``template``'s format fields start with; ValueError when it is malformed or
    has a positional field (``{}``, ``{0}``): every field names a keyword list."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"template is not a valid format string: {exc}") from None
    names = [re.split(r"[.\[]", name, maxsplit=1)[0] for name in fields]
    for name in names:
        if not name.isidentifier():
            raise ValueError(
                f"template field {{{name}}} is not a name: fields name the sample's values "
                "({prompt}, {completion}, {answer}, any meta key); write {{ and }} for braces"
            )
    return names


@dataclass
class JudgeSpec:
    url: str = field(
        metadata={"doc": "the judge engine's URL (the built-in engine or SGLang): http://HOST:PORT"}
    )
    template: str = field(
        metadata={
            "doc": "the judge's prompt, a Python format string: {prompt}, {completion} and any "
            "other keyword a reward function gets, one sample's value each ({answer}...)"
        }
    )
    parse: str = field(
        default="",
        metadata={
            "doc": "routes generate and chat: regular expression with one group, searched in the "
            "judge's answer: the group is the score (a number, or a key of map)"
        },
    )
    map: dict[str, float] = field(
        default_factory=dict,
        metadata={
            "doc": 'score of each text the group may be ({"yes": 1, "no": 0}); empty: a number. '
            "Route decisions: the value of each candidate (option name, level number, yes or no)"
        },
    )
    route: Literal["generate", "chat", "decisions"] = _f(
        "generate",
        "generate: /generate with the prompt as it is, up to batch_size prompts a request; "
        "chat: /v1/chat/completions with the prompt as the user's message (the engine's chat "
        "template applies), one sample a request; decisions: /v1/decisions with the prompt as "
        "its input and question asked of it, the reward the expected value of the candidates "
        "under their probabilities (no text generated, no parse), one sample a request",
    )
    question: dict[str, Any] | None = field(
        default=None,
        metadata={
            "doc": "route decisions: the question, as /v1/decisions takes it ({type: yes_no, "
            "question: ...}; {type: score, question, levels: [...]}; {type: choice, question, "
            "options: [{name, description}...]}); the reward is P(yes), the expected level, or "
            "the options' map values weighed by their probabilities (map overrides each)"
        },
    )
    system: str = _f("", "chat route: a system message before it")
    model: str = _f("default", "chat route: the request's model")
    max_new_tokens: int = _f(32, "the judge's answer length", min=1)
    temperature: float = _f(0.0, "sampling temperature (0: greedy)", min=0.0)

    def __post_init__(self) -> None:
        http_url(self.url, "url")
        _template_fields(self.template)
        if self.route == "decisions":
            self._check_question()
            return
        if self.question is not None:
            raise ValueError("question applies to route: decisions")
        if not self.parse:
            raise ValueError(f"route {self.route} needs parse: where the score is in the answer")
        try:
            groups = re.compile(self.parse).groups
        except re.error as exc:
            raise ValueError(f"parse {self.parse!r} is not a regular expression: {exc}") from None
        if groups != 1:
            raise ValueError(f"parse {self.parse!r} has {groups} groups: it needs exactly one")
        if self.system and self.route != "chat":
            raise ValueError("system applies to route: chat (with generate, put it in template)")

    def _check_question(self) -> None:
        """The question as /v1/decisions reads it, and a value for each of its candidates."""
        if self.question is None:
            raise ValueError("route decisions needs question: what the judge is asked")
        if self.parse or self.system:
            raise ValueError("parse and system apply to routes generate and chat")
        from stages.engine.openai_decisions import request_error, values_of

        why = request_error({"input": "x", "questions": [{**self.question, "id": "q"}]})
        if why is not None:
            raise ValueError(f"question: {why}")
        values_of(self.question, self.map)  # ValueError: a candidate without a value


@dataclass
class RewardModelSpec:
    url: str | None = _f(
        None,
        "the engine serving the reward model (inflight engine or SGLang with --is-embedding, "
        "on a *ForSequenceClassification checkpoint): http://HOST:PORT",
    )
    launch: LaunchConfig | None = field(
        default=None,
        metadata={
            "doc": "start the reward model's engine with the scorer instead: the generator's "
            "launch options (kind builtin|sglang, model, device, dtype, python, extra_args...), "
            "one engine in a process of its own (SGLang gets --is-embedding)"
        },
    )
    input: Literal["chat", "text", "pair"] = _f(
        "chat",
        "chat: the sample's conversation (meta messages, else its prompt as the user's message) "
        "and the completion as the assistant's turn, rendered by the reward model's own chat "
        "template (the engine's /v1/tokenize); text: template filled, as it is; pair: a "
        "cross-encoder's [query, document] pair (pair's two templates filled), encoded as the "
        "model's tokenizer encodes a text pair (is_cross_encoder_request)",
    )
    template: str = _f(
        "{prompt}{completion}",
        "input text: a Python format string over the sample's values ({prompt}, "
        "{completion}, {answer}, any meta key)",
    )
    pair: list[str] = field(
        default_factory=lambda: ["{prompt}", "{completion}"],
        metadata={
            "doc": "input pair: the query's and the document's templates (format strings over "
            "the sample's values, as template's)"
        },
    )
    label: int = _f(0, "which of the model's outputs is the reward (one-label models: 0)", min=0)

    def __post_init__(self) -> None:
        if (self.url is None) == (self.launch is None):
            raise ValueError(
                "a reward model has exactly one of url (an engine you started) or launch (the "
                "scorer starts one)"
            )
        if self.url is not None:
            http_url(self.url, "url")
        else:
            check_one_engine(self.launch, "the reward model's")
        _template_fields(self.template)
        if self.input != "text" and self.template != "{prompt}{completion}":
            raise ValueError(
                "template applies to input: text (chat renders the conversation; pair fills pair)"
            )
        if not (isinstance(self.pair, list) and len(self.pair) == 2):
            raise ValueError("pair is [query template, document template]: two format strings")
        for template in self.pair:
            _template_fields(template)
        if self.input != "pair" and self.pair != ["{prompt}", "{completion}"]:
            raise ValueError("pair applies to input: pair")


@dataclass
class RewardSpec:
    fn: str | None = _f(
        None, "reward function: entry point of inflight.rewards or package.module:name"
    )
    url: str | None = _f(None, "reward server: its URL (POST, JSON lists in and out)")
    judge: JudgeSpec | None = field(
        default=None, metadata={"doc": "a generative judge served by an engine"}
    )
    reward_model: RewardModelSpec | None = field(
        default=None,
        metadata={"doc": "a reward model (sequence classifier) served by an engine's /classify"},
    )
    weight: float = _f(1.0, "its weight in the summed reward")
    name: str = _f(
        "",
        "its name in reward_info, logs and metrics (default: fn, the URL without its scheme, "
        "judge:HOST:PORT or rm:HOST:PORT)",
    )
    protocol: Literal["inflight", "slime"] = _f(
        "inflight",
        "url: inflight (lists of samples in, {rewards: [...]} out; OpenRLHF's remote reward "
        "model fields included) or slime (slime's --rm-url: one sample a request)",
    )
    timeout_s: float = http_option("timeout_s", "url, judge, reward_model: ")
    retries: int = http_option("retries", "url, judge, reward_model: ")
    backoff_s: float = http_option("backoff_s", "url, judge, reward_model: ")
    concurrency: int = http_option("concurrency", "url, judge, reward_model: ")
    batch_size: int | None = http_option("batch_size", "url, judge, reward_model: ")
    headers: dict[str, str] = http_option("headers", "url, judge, reward_model: ")  # noqa: RUF009 (a field)

    def __post_init__(self) -> None:
        kinds = [k for k in ("fn", "url", "judge", "reward_model") if getattr(self, k) is not None]
        if len(kinds) != 1:
            has = " and ".join(kinds) if kinds else "none of them"
            raise ValueError(
                f"a reward has exactly one of fn, url, judge or reward_model (this one has {has})"
            )
        if self.fn is not None:
            resolve_function("reward", self.fn)  # an unknown name is a config error
            self._only_http(*_HTTP_OPTIONS, "protocol")
            self.name = self.name or self.fn
            return
        check_headers(self.headers)
        if self.url is not None:
            parts = urlsplit(http_url(self.url, "url"))
            if self.protocol == "slime" and self.batch_size not in (None, 1):
                raise ValueError("batch_size: protocol slime sends one sample a request")
            self.name = self.name or f"{parts.netloc}{parts.path.rstrip('/')}"
            return
        if self.reward_model is not None:
            self._only_http("protocol")
            model = self.reward_model
            where = urlsplit(model.url).netloc if model.url else model.launch.model.rstrip("/")
            self.name = self.name or f"rm:{where}"
            return
        assert self.judge is not None
        self._only_http("protocol")
        if self.judge.route == "chat" and self.batch_size not in (None, 1):
            raise ValueError("batch_size: a judge on route chat gets one sample a request")
        self.name = self.name or f"judge:{urlsplit(self.judge.url).netloc}"

    def _only_http(self, *keys: str) -> None:
        """A ValueError naming the first of ``keys`` this reward sets that it has no use for."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        for key in keys:
            known = fields[key]
            unset = (
                known.default
                if known.default_factory is dataclasses.MISSING
                else known.default_factory()
            )
            if getattr(self, key) == unset:
                continue
            if key == "protocol":
                raise ValueError("protocol applies to url rewards only")
            hint = (
                " (a function's time limit is the scorer's timeout_s)" if key == "timeout_s" else ""
            )
            raise ValueError(f"{key} applies to url, judge and reward_model rewards only{hint}")
