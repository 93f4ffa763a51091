"""``/v1/rerank`` on the built-in engine as a real server, as SGLang 0.5.23 serves a decoder
reranker (``serving_rerank.py``: ``_is_qwen3_reranker_template``, ``_render_jinja_chat_template``,
``_handle_text_reranker_request``, ``_qwen3_rerank_score``, ``_build_rerank_response``,
``_validate_request``; ``protocol.V1RerankReqInput``, ``RerankResponse``), each score held to
``/v1/score``'s probabilities of ``yes`` and ``no`` after the same rendered prompt."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jinja2
import pytest
import requests
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_byte_model, make_tagged_byte_model

# a reranker's template in the way Qwen3-Reranker's is written (not its text): it says the
# answer can only be "yes" or "no", and reads the query, the document and an instruction
TEMPLATE = (
    'judge the document for the query; the answer can only be "yes" or "no".\n'
    "task: {{ instruct | default('find the passage that answers') }}\n"
    "query: {{ messages[0]['content'] }}\n"
    "document: {{ messages[1]['content'] }}\n"
    "answer: "
)
DOCS = ["a cat sat on the mat", "the sky is blue", "cats like mats", "no relation at all"]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("rerank")
    model = make_tagged_byte_model(folder / "model", ("yes", "no"))
    template = folder / "template.jinja"
    template.write_text(TEMPLATE)
    with builtin_engine(model, "--chat-template", str(template)) as found:
        yield found


def _post(url: str, body: Any, method: str = "POST") -> requests.Response:
    return requests.request(method, url + "/v1/rerank", json=body, timeout=30)


def _expected(url: str, query: str, docs: list[str], instruct: str | None = None) -> list[float]:
    """Each document's p(yes) / (p(yes) + p(no)), from /v1/score of the prompt SGLang renders."""
    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), autoescape=False)
    tokens = requests.post(url + "/v1/tokenize", json={"prompt": "yes no"}, timeout=30).json()
    yes, no = tokens["tokens"][0], tokens["tokens"][-1]
    prompts = []
    for doc in docs:
        kwargs: dict[str, Any] = {"messages": [{"role": "user", "content": query},
                                               {"role": "user", "content": doc}]}  # fmt: skip
        if instruct:
            kwargs["instruct"] = instruct
        prompts.append(env.from_string(TEMPLATE).render(**kwargs))
    body = {"items": prompts, "label_token_ids": [yes, no]}
    scored = requests.post(url + "/v1/score", json=body, timeout=30).json()["scores"]
    return [p_yes / (p_yes + p_no) for p_yes, p_no in scored]


@pytest.mark.timeout(60)
def test_documents_come_most_relevant_first_with_their_scores(url: str) -> None:
    answer = _post(url, {"query": "where is the cat", "documents": DOCS})
    assert answer.status_code == 200, answer.text
    ranked = answer.json()
    want = _expected(url, "where is the cat", DOCS)
    assert sorted(r["index"] for r in ranked) == [0, 1, 2, 3]
    for r in ranked:
        assert list(r) == ["score", "document", "index", "meta_info"]  # RerankResponse's
        assert r["document"] == DOCS[r["index"]] and r["meta_info"] is None
        assert abs(r["score"] - want[r["index"]]) < 1e-6 and 0 < r["score"] < 1
    assert [r["score"] for r in ranked] == pytest.approx(sorted(want, reverse=True), abs=1e-6)
    # top_n, return_documents false, an instruction, and SGLang's PUT
    body = {"query": "where is the cat", "documents": DOCS, "top_n": 2,
            "return_documents": False, "instruct": "find a cat"}  # fmt: skip
    top = _post(url, body, "PUT").json()
    instructed = _expected(url, "where is the cat", DOCS, "find a cat")
    assert [list(r) for r in top] == [["score", "index", "meta_info"]] * 2
    best = sorted(instructed, reverse=True)[:2]
    assert [r["score"] for r in top] == pytest.approx(best, abs=1e-6)
    assert instructed != want  # the instruction is in the prompt


@pytest.mark.timeout(60)
def test_what_sglang_refuses_is_a_400_in_its_words(url: str) -> None:
    cases = [
        ({"query": "", "documents": DOCS}, "Query cannot be empty"),
        ({"query": "  ", "documents": DOCS}, "Query cannot be empty or whitespace only"),
        ({"query": "q", "documents": []}, "Documents cannot be empty"),
        ({"query": "q", "documents": ["a", ""]}, "Each document must be a non-empty string"),
        ({"query": "q", "documents": ["a", " "]},
         "Each document cannot be empty or whitespace only"),
        ({"query": "q", "documents": DOCS, "top_n": 0},
         "Value error, parameter top_n should be larger than 0."),
        ({"documents": DOCS}, "query: Field required"),
        ({"query": "q"}, "documents: Field required"),
        ({"query": "q", "documents": [[{"type": "image_url", "image_url": {"url": "x"}}]]},
         "text only"),
    ]  # fmt: skip
    for body, words in cases:
        answer = _post(url, body)
        assert answer.status_code == 400, (body, answer.text)
        refused = answer.json()
        assert refused["object"] == "error" and words in refused["message"], (body, refused)
    assert requests.get(url + "/health", timeout=10).status_code == 200


@pytest.mark.timeout(60)
def test_a_model_that_is_no_reranker_is_refused_as_sglang_refuses_it(tmp_path) -> None:
    """Without a reranker's template SGLang reranks with a cross-encoder, which a generating
    model is not: its 400 (the pooling routes' on a generating model)."""
    with builtin_engine(make_byte_model(tmp_path / "model")) as url:
        answer = _post(url, {"query": "q", "documents": ["a"]})
    assert answer.status_code == 400
    assert "does not appear to be an embedding model" in answer.json()["message"]
