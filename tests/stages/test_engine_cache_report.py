"""``--enable-cache-report`` on the built-in engine as a real server: the ``/v1`` answers'
``usage.prompt_tokens_details.cached_tokens``, as SGLang 0.5.23 reports them
(``usage_processor.calculate_response_usage`` and ``calculate_streaming_usage``: each prompt's
cached tokens once, whatever ``n``; ``PromptTokensDetails``; a stream's usage chunk without its
null fields), through the ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import requests

from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_byte_model

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
TEXT = "the same long prompt, again and again, so that its prefix is cached"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("cache_report")
    model = make_byte_model(folder / "model")
    template = folder / "chat_template.jinja"
    template.write_text(TEMPLATE)
    with builtin_engine(
        model, "--enable-cache-report", "--chat-template", str(template)
    ) as found:  # fmt: skip
        yield found


@pytest.mark.timeout(60)
def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    first = client.completions.create(model="m", prompt=TEXT, max_tokens=2, n=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet
    again = client.completions.create(model="m", prompt=TEXT, max_tokens=2, n=2)
    native = requests.post(
        url + "/generate", json={"text": TEXT, "sampling_params": {"max_new_tokens": 1}}, timeout=30
    ).json()
    cached = native["meta_info"]["cached_tokens"]
    assert 0 < cached < again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == cached  # once for n = 2
    body = {"model": "m", "prompt": TEXT, "max_tokens": 2}
    raw = requests.post(url + "/v1/completions", json=body, timeout=30).json()
    assert raw["usage"]["prompt_tokens_details"] == {
        "cached_tokens": cached, "image_tokens": None, "audio_tokens": None,
        "video_tokens": None,
    }  # fmt: skip
    stream = client.completions.create(
        model="m", prompt=TEXT, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    last = list(stream)[-1]
    assert last.choices == [] and last.usage.prompt_tokens_details.cached_tokens == cached
    assert last.usage.prompt_tokens_details.model_extra == {}
    messages = [{"role": "user", "content": TEXT}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    streamed = client.chat.completions.create(
        model="m", messages=messages, max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    assert list(streamed)[-1].usage.prompt_tokens_details.cached_tokens > 0
