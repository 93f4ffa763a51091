"""Make ``configs/models/calc-chat-tiny``: the chat model of the function-calling agent example
(``configs/calculator_agent.yaml``), the calculator's task (``123*456=``, which the model cannot
work out in its head) through a chat template and OpenAI-style tool calls.

Usage (from the repository root; about 2 minutes on one CPU thread)::

    python configs/models/make_calc_chat_model.py [--out configs/models/calc-chat-tiny]

The tokenizer is one token per character of ``0123456789+-*=`` (``<pad>`` 0, ``<eos>`` 1, then
2..15) plus added tokens, each one id, matched whole: the roles ``<|user|>`` and
``<|assistant|>``, the Qwen 2.5 / Hermes tool-call tags ``<tool_call>`` ``</tool_call>``
``<tool_response>`` ``</tool_response>``, and the two fixed pieces of a ``calc`` call's JSON,
``{"name": "calc", "arguments": {"expression": "`` and ``"}}`` (so a call is 12 tokens, not 60).
Its chat template (saved with the tokenizer) renders a conversation the way the engine's
``/v1/chat/completions`` and the agent proxy need it: ``<|user|>`` and the text, an assistant
turn as ``<|assistant|>``, its text, each tool call as ``<tool_call>{"name": NAME,
"arguments": ARGUMENTS}</tool_call>`` (name first, as Qwen 2.5's template writes it, whatever
order the client sent), then ``<eos>``; a tool message as ``<tool_response>...
</tool_response>``; ``add_generation_prompt`` adds ``<|assistant|>``. Its calls are read
with ``--tool-call-parser hermes`` (the rollouts' ``tool_call_parser: hermes``: SGLang's
template detection finds no parser in it, ``stages.engine.template_detection``). An
episode, "sampled" by the model and "inserted" by the template (never trained)::

    tool use       <|user|>123*456=<|assistant|>                       prompt
                   <tool_call>{"name": "calc", "arguments":
                     {"expression": "123*456"}}</tool_call><eos>       sampled
                   <tool_response>56088</tool_response><|assistant|>   inserted
                   56088<eos>                                          sampled
    direct answer  <|user|>123*456=<|assistant|>                       prompt
                   56088<eos>                                          sampled

which is what an ``openai`` agent that sends the tool's answer back as a ``tool`` message makes
(``stages.rollouts.examples.calc_agent``). The reward is exact match of the final answer.

The warm start is the calculator's (``make_calc_model.py``: the same shape, demonstrations,
tool shares and stop rule; see there for why): a model that calls the tool well when it does,
and does so for about a quarter of the episodes sampled at temperature 1, so that RL has to
teach it to reach for the tool. One JSON line reports the figures on held-out problems.
"""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from make_calc_model import Episode, calc, warm_start, warm_start_arguments
from tiny_lm import char_tokenizer, sample
from transformers import PreTrainedTokenizerFast

from stages.feeder.arithmetic import EOS_ID, PAD_ID, Problem

CHARS = "0123456789+-*="
CALL_OPEN = '{"name": "calc", "arguments": {"expression": "'
CALL_CLOSE = '"}}'
ADDED = (
    "<|user|>",
    "<|assistant|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    CALL_OPEN,
    CALL_CLOSE,
)
VOCAB_SIZE = 2 + len(CHARS) + len(ADDED)  # 24
# the context is the calculator's (64): the longest episode is 36 tokens
TURN_TOKENS = 16  # a turn's most new tokens: a call is 12 with its tags and <eos>, an answer 7
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{{ message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "<tool_call>{\"name\": {{ call['name'] | tojson }}, "
    "\"arguments\": {{ call['arguments'] | tojson }}}"
    "</tool_call>"
    "{%- endfor -%}{{ eos_token }}"
    "{%- elif message['role'] == 'tool' -%}<tool_response>{{ message['content'] }}</tool_response>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

_IDS = {"<pad>": PAD_ID, "<eos>": EOS_ID} | {c: i + 2 for i, c in enumerate(CHARS)}
_IDS |= {t: 2 + len(CHARS) + i for i, t in enumerate(ADDED)}
_TEXT = {i: t for t, i in _IDS.items()}
_PIECE = re.compile("|".join(re.escape(t) for t in (*ADDED, "<eos>")) + "|.", re.DOTALL)
_CALL = re.compile(
    re.escape("<tool_call>" + CALL_OPEN) + r"(\d+[*+-]\d+)" + re.escape(CALL_CLOSE + "</tool_call>")
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer with the added tokens above and the chat template."""
    tok = char_tokenizer(CHARS, added=ADDED)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def encode(text: str) -> list[int]:
    """Token ids of ``text`` as ``make_tokenizer`` gives them (added tokens and ``<eos>`` whole)."""
    return [_IDS[piece] for piece in _PIECE.findall(text)]


def decode(ids: Sequence[int]) -> str:
    """Text of ``ids`` without ``<pad>`` / ``<eos>`` (as ``skip_special_tokens``)."""
    return "".join(_TEXT[int(i)] for i in ids if i not in (PAD_ID, EOS_ID))


def prompt_text(problem: Problem) -> str:
    return f"<|user|>{problem.text}<|assistant|>"


def call_text(expression: str) -> str:
    return f"<tool_call>{CALL_OPEN}{expression}{CALL_CLOSE}</tool_call>"


def teacher_episode(
    problem: Problem, rng: random.Random, share: float, share_9: float
) -> list[tuple[str, bool]]:
    """A demonstration, as (text, sampled) segments: a tool call with probability ``share_9``
    when the first operand starts with 9, else ``share``; otherwise a direct answer (the true
    product: unlearnable, so it stays a guess)."""
    p = share_9 if problem.text[0] == "9" else share
    if rng.random() >= p:
        return [(prompt_text(problem), False), (f"{problem.answer}<eos>", True)]
    return [
        (prompt_text(problem), False),
        (call_text(problem.text[:-1]) + "<eos>", True),
        (f"<tool_response>{problem.answer}</tool_response><|assistant|>", False),
        (f"{problem.answer}<eos>", True),
    ]


def run_episodes(
    model: torch.nn.Module,
    items: Sequence[Problem],
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    max_calls: int = 2,
) -> list[Episode]:
    """Play each problem as the example's agent does: a turn ends at ``<eos>``; one that is a
    well-formed call gets the tool's answer and a new assistant turn; any other is the answer
    (a malformed call, or a turn cut off after ``TURN_TOKENS``, ends it without one)."""
    eps = [Episode(encode(prompt_text(p))) for p in items]
    call_id = _IDS["<tool_call>"]
    active = list(range(len(items)))
    for turn in range(max_calls + 1):
        if not active:
            break
        outs = sample(
            model,
            [eps[i].ids for i in active],
            temperature=temperature,
            generator=generator,
            max_new_tokens=TURN_TOKENS,
            stop_ids=(EOS_ID,),
        )
        going = []
        for i, out in zip(active, outs, strict=True):
            ep = eps[i]
            ep.ids += out
            if turn == 0:
                ep.first_call = bool(out) and out[0] == call_id
            if not out or out[-1] != EOS_ID:
                continue  # cut off
            text = decode(out)
            if "<tool_call>" not in text:
                ep.answer = text
                continue
            m = _CALL.fullmatch(text)
            value = calc(m[1]) if m and ep.calls < max_calls else None
            if value is not None:
                ep.ids += encode(f"<tool_response>{value}</tool_response><|assistant|>")
                ep.calls += 1
                going.append(i)
        active = going
    return eps


def main(argv: Sequence[str] | None = None) -> int:
    args = warm_start_arguments(Path(__file__).parent / "calc-chat-tiny").parse_args(argv)
    return warm_start(
        args,
        teacher=teacher_episode,
        encode=encode,
        play=run_episodes,
        tokenizer=make_tokenizer(),
        vocab_size=VOCAB_SIZE,
        turn_tokens=TURN_TOKENS,
    )


if __name__ == "__main__":
    sys.exit(main())
