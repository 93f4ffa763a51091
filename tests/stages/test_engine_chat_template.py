"""``stages.engine.chat_template.TemplateRenderer`` renders every conversation to the text
``apply_chat_template(..., tokenize=False)`` gives, through transformers' own parts: a probe
template that writes out everything a template sees (the messages as it gets them, tools,
special tokens, keywords), the shipped models' templates and the tests' tool and thinking
templates, over messages of every kind a chat or Responses request makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from stages.engine import chat_template
from stages.engine.chat_template import TemplateRenderer
from stages.engine.openai_chat import ChatSettings
from tests.stages.test_engine_chat import TOOLS
from tests.stages.test_engine_reasoning import QWEN3_TOGGLE
from tests.stages.tool_tokenizers import QWEN_LIKE, TAGS, char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "{{ messages | tojson }}|{{ tools | tojson }}|{{ documents | tojson }}|"
    "{{ add_generation_prompt }}|{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|"
    "{{ additional_special_tokens }}|{{ enable_thinking }}|{{ reasoning_effort }}|"
    "{% for m in messages %}{{ m.thinking }},{{ m.reasoning_content }};{% endfor %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "12+34="}],
    [{"role": "system", "content": "You add."}, {"role": "user", "content": "1+1="}],
    [  # a tool round: a call (arguments as an object, content None), its answer
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": {"a": 1, "b": 2}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3", "name": None},
    ],
    [  # reasoning under each of its names, and none
        {"role": "user", "content": "think"},
        {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "5", "reasoning": "2+3", "reasoning_content": None},
        {"role": "assistant", "content": "6", "thinking": "3+3"},
        {"role": "user", "content": [{"type": "text", "text": "parts"}, {"type": "text"}]},
    ],
]
KWARGS = [{}, {"enable_thinking": True}, {"reasoning_effort": "low", "eos_token": "<mine>"}]


def _tokenizers() -> list[tuple[str, object, str | None]]:
    chat = AutoTokenizer.from_pretrained(ROOT / "configs/models/calc-chat-tiny")
    arith = AutoTokenizer.from_pretrained(ROOT / "configs/models/arith-tiny")
    tagged = char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789+=", special=TAGS)
    return [
        ("calc-chat-tiny", chat, None),  # its own template
        ("calc-chat-tiny+probe", chat, PROBE),
        ("arith-tiny+probe", arith, PROBE),
        ("tags+probe", tagged, PROBE),
        ("tags+qwen-like", tagged, QWEN_LIKE),
        ("tags+qwen3-toggle", tagged, QWEN3_TOGGLE),
    ]


@pytest.mark.parametrize("name,tokenizer,template", _tokenizers(), ids=lambda v: v)
def test_the_text_is_apply_chat_templates(name: str, tokenizer: object, template: str) -> None:
    renderer = TemplateRenderer(tokenizer)
    assert renderer.fast, "transformers' parts are importable here: the fast path is the one tested"
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            for kwargs in KWARGS:
                for prompt in (True, False):
                    want = tokenizer.apply_chat_template(
                        messages,
                        tools=tools,
                        chat_template=template,
                        add_generation_prompt=prompt,
                        tokenize=False,
                        **kwargs,
                    )
                    got = renderer.render(messages, tools, template, prompt, dict(kwargs))
                    assert got == want, (name, messages, tools, kwargs, prompt)


def test_the_probe_sees_what_a_template_is_given() -> None:
    """The probe is sensitive: None fields dropped, reasoning under every name, keywords over
    the special tokens (else the parity above would prove little)."""
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "configs/models/calc-chat-tiny")
    text = TemplateRenderer(tokenizer).render(CONVERSATIONS[3], None, PROBE, True, KWARGS[2])
    messages = json.loads(text.split("|", 1)[0])
    if chat_template._DROPS_NONE and chat_template._alias is not None:
        assert messages[3] == {"thinking": "2+3", "role": "assistant", "content": "5",
                               "reasoning": "2+3", "reasoning_content": "2+3"}  # fmt: skip
    else:  # an older transformers (5.19, SGLang 0.5.23's pin) hands the message on as it is
        assert messages[3] == CONVERSATIONS[3][3]
    assert "|<mine>|" in text and "|low|" in text


def test_what_the_fast_path_cannot_take_goes_through_apply_chat_template() -> None:
    """A keyword ``apply_chat_template`` owns (``tokenize``) and a message that is not a plain
    dict get its own answer; an empty conversation and a template's own ``raise_exception``
    raise what it raises."""
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "configs/models/calc-chat-tiny")
    renderer = TemplateRenderer(tokenizer)
    hello = CONVERSATIONS[0]
    with pytest.raises(TypeError, match="multiple values for keyword argument 'tokenize'"):
        renderer.render(hello, None, None, True, {"tokenize": True})

    class Message(dict):
        pass

    assert renderer.render([Message(hello[0])], None, None, True, {}) == (
        tokenizer.apply_chat_template(hello, add_generation_prompt=True, tokenize=False)
    )
    with pytest.raises(ValueError, match="empty conversation") as fast:
        renderer.render([], None, None, True, {})
    with pytest.raises(ValueError, match="empty conversation") as slow:
        tokenizer.apply_chat_template([], tokenize=False)
    assert str(fast.value) == str(slow.value)
    refuse = "{{ raise_exception('no system messages') }}"
    for render in (
        lambda: renderer.render(hello, None, refuse, True, {}),
        lambda: tokenizer.apply_chat_template(hello, chat_template=refuse, tokenize=False),
    ):
        with pytest.raises(Exception, match="no system messages"):
            render()


def test_without_transformers_parts_it_is_apply_chat_template(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another transformers, without the private parts: every render is
    ``apply_chat_template``'s (the same text)."""
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "configs/models/calc-chat-tiny")
    monkeypatch.setattr(chat_template, "_compile", None)
    renderer = TemplateRenderer(tokenizer)
    assert not renderer.fast
    want = tokenizer.apply_chat_template(CONVERSATIONS[2], tools=TOOLS, tokenize=False)
    assert renderer.render(CONVERSATIONS[2], TOOLS, None, False, {}) == want


def test_chat_settings_render_through_it() -> None:
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "configs/models/calc-chat-tiny")
    settings = ChatSettings.of(tokenizer, ROOT / "configs/models/calc-chat-tiny")
    assert settings is not None and settings.renderer.fast
    text = tokenizer.apply_chat_template(
        CONVERSATIONS[0], add_generation_prompt=True, tokenize=False
    )
    assert settings.render(CONVERSATIONS[0], None, {}) == tokenizer.encode(
        text, add_special_tokens=False
    )
