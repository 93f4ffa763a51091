"""SGLang's sessions on the built-in engine (``stages.engine.sessions``): ``/open_session``,
``/close_session`` and ``/generate``'s ``session_params``, as SGLang 0.5.23's non-streaming
sessions compose a request's prompt (``session/session_controller.py`` ``create_req``,
``_concat_token_arrays``) and answer what they refuse (``managers/scheduler.py``
``handle_generate_request``, ``tokenizer_control_mixin.open_session``).

The tree's rules run in process, with a stand-in abort; the routes on a real engine, whose
greedy answers to a session's turns equal its answers to the composed prompts sent whole.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from openai import BadRequestError, OpenAI

from stages.engine.sessions import SessionError, Sessions
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_tiny_model

GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
A, B, C = [5, 17, 33, 8], [41, 12], [9, 9, 30]


# ---- the tree, in process ------------------------------------------------------------------


def _sessions() -> tuple[Sessions, list[str]]:
    aborted: list[str] = []
    return Sessions(aborted.extend), aborted


def test_a_turn_continues_the_request_it_names_with_its_output() -> None:
    sessions, _ = _sessions()
    sid = sessions.open({"capacity_of_str_len": 100})
    assert len(sid) == 32
    ids, first = sessions.prompt({"id": sid}, A, "t1", bos=None)
    assert ids == A
    sessions.ended(first, [70, 71])
    assert sessions.prompt({"id": sid, "rid": "t1"}, [1, *B], "t2", bos=1)[0] == [*A, 70, 71, *B]
    drop = {"id": sid, "rid": "t1", "drop_previous_output": True}
    assert sessions.prompt(drop, B, "t3", bos=None)[0] == A + B
    cut = {"id": sid, "rid": "t1", "offset": 5}
    assert sessions.prompt(cut, B, "t4", bos=None)[0] == [*A, 70, *B]
    assert sessions.prompt({"id": sid}, C, "t5", bos=None)[0] == C  # no rid: no history


def test_a_turn_on_a_request_still_running_or_unknown_is_refused_in_sglangs_words() -> None:
    sessions, _ = _sessions()
    sid = sessions.open({"capacity_of_str_len": 100, "session_id": "s"})
    assert sid == "s"
    sessions.prompt({"id": sid}, A, "t1", bos=None)
    with pytest.raises(SessionError, match="appending to a request that hasn't finished"):
        sessions.prompt({"id": sid, "rid": "t1"}, B, "t2", bos=None)
    with pytest.raises(SessionError, match=r"^Invalid request session id$"):
        sessions.prompt({"id": sid, "rid": "nope"}, B, "t3", bos=None)
    with pytest.raises(SessionError, match="session id other does not exist"):
        sessions.prompt({"id": "other"}, B, "t4", bos=None)
    with pytest.raises(SessionError, match="must contain input tokens"):
        sessions.prompt({"id": sid}, [], "t5", bos=None)
    with pytest.raises(SessionError, match="Check if a session with the same id is still open"):
        sessions.open({"capacity_of_str_len": 1, "session_id": "s"})
    with pytest.raises(SessionError, match="--enable-streaming-session"):
        sessions.open({"capacity_of_str_len": 1, "streaming": True})


def test_replace_cuts_the_branch_after_the_request_and_aborts_what_runs_there() -> None:
    sessions, aborted = _sessions()
    sid = sessions.open({"capacity_of_str_len": 100})
    _, t1 = sessions.prompt({"id": sid}, A, "t1", bos=None)
    sessions.ended(t1, [70])
    _, t2 = sessions.prompt({"id": sid, "rid": "t1"}, B, "t2", bos=None)
    sessions.prompt({"id": sid, "rid": "t1"}, C, "t3", bos=None)  # t2 and t3 still run
    sessions.ended(t2, [80])
    sessions.prompt({"id": sid, "rid": "t2"}, C, "t4", bos=None)
    ids, _ = sessions.prompt({"id": sid, "rid": "t1", "replace": True}, B, "t5", bos=None)
    assert ids == [*A, 70, *B] and sorted(aborted) == ["t3", "t4"]  # t2 had ended
    with pytest.raises(SessionError, match=r"^Invalid request session id$"):
        sessions.prompt({"id": sid, "rid": "t2"}, C, "t6", bos=None)
    sessions.prompt({"id": sid, "replace": True}, C, "t7", bos=None)  # every request cleared
    assert "t5" in aborted
    with pytest.raises(SessionError, match=r"^Invalid request session id$"):
        sessions.prompt({"id": sid, "rid": "t1"}, C, "t8", bos=None)


def test_a_request_refused_before_it_ran_leaves_the_session_as_it_was() -> None:
    sessions, _ = _sessions()
    sid = sessions.open({"capacity_of_str_len": 100})
    _, t1 = sessions.prompt({"id": sid}, A, "t1", bos=None)
    sessions.ended(t1, [70])
    _, again = sessions.prompt({"id": sid}, B, "t1", bos=None)  # the same rid, then refused
    sessions.forget(again)
    assert sessions.prompt({"id": sid, "rid": "t1"}, C, "t2", bos=None)[0] == [*A, 70, *C]


def test_a_streaming_session_appends_each_turn_to_the_last_that_ended_well() -> None:
    """One turn at a time; an aborted turn leaves the session as it was; replace, offset and
    drop_previous_output refused in SGLang's words; a close while a turn runs waits for it."""
    sessions, _ = _sessions()
    with pytest.raises(SessionError, match="--enable-streaming-session"):
        sessions.open({"capacity_of_str_len": 1, "streaming": True})
    sessions = Sessions(lambda rids: None, streaming=True)
    sid = sessions.open({"capacity_of_str_len": 100, "streaming": True})
    ids, t1 = sessions.prompt({"id": sid}, A, "t1", bos=None)
    assert ids == A
    with pytest.raises(SessionError, match="already has an active request"):
        sessions.prompt({"id": sid}, B, "t2", bos=None)
    sessions.ended(t1, [70])
    _, t2 = sessions.prompt({"id": sid, "rid": "ignored"}, B, "t2", bos=None)
    sessions.ended(t2, [80, 81], aborted=True)  # rolled back
    ids, t3 = sessions.prompt({"id": sid}, C, "t3", bos=None)
    assert ids == [*A, 70, *C]
    for params, words in (({"replace": True}, "replace"), ({"offset": 2}, "offset"),
                          ({"drop_previous_output": True}, "drop_previous_output")):  # fmt: skip
        sessions.ended(t3, [90])
        with pytest.raises(SessionError, match=f"do not support {words}"):
            sessions.prompt({"id": sid, **params}, B, "t4", bos=None)
    _, t4 = sessions.prompt({"id": sid}, B, "t4", bos=None)
    sessions.close(sid)  # deferred: t4 runs
    with pytest.raises(SessionError, match="close was requested"):
        sessions.prompt({"id": sid}, B, "t5", bos=None)
    sessions.ended(t4, [1])
    with pytest.raises(SessionError, match="does not exist"):
        sessions.prompt({"id": sid}, B, "t5", bos=None)


def test_an_idle_session_past_its_timeout_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    # the machine's own clock to start from: a session takes its first activity from the
    # real clock (a fixed 1000 s read as idle for long on a machine up for less than that)
    clock = [time.monotonic()]
    monkeypatch.setattr("stages.engine.sessions.time.monotonic", lambda: clock[0])
    sessions, _ = _sessions()
    sid = sessions.open({"capacity_of_str_len": 100, "timeout": 5.0})
    sessions.prompt({"id": sid}, A, "t1", bos=None)
    clock[0] += 6
    with pytest.raises(SessionError, match="does not exist"):
        sessions.prompt({"id": sid}, A, "t2", bos=None)


# ---- the routes, on a real engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = make_tiny_model(tmp_path_factory.mktemp("models") / "m", seed=5)
    with builtin_engine(model, "--max-running", "4") as engine:
        yield engine


def _generate(url: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(url + "/generate", json=body, timeout=30)


def _open(url: str, **body: Any) -> requests.Response:
    return requests.post(
        url + "/open_session", json={"capacity_of_str_len": 1000, **body}, timeout=30
    )


@pytest.mark.timeout(120)
def test_a_sessions_turns_answer_as_their_composed_prompts_sent_whole(url: str) -> None:
    sid = _open(url).json()
    assert isinstance(sid, str) and len(sid) == 32
    first = _generate(url, {"input_ids": A, "sampling_params": GREEDY, "rid": "t1",
                            "session_params": {"id": sid}}).json()  # fmt: skip
    o1 = first["output_ids"]
    assert first["meta_info"]["prompt_tokens"] == len(A)
    second = _generate(url, {"input_ids": B, "sampling_params": GREEDY, "rid": "t2",
                             "session_params": {"id": sid, "rid": "t1"}}).json()  # fmt: skip
    whole = _generate(url, {"input_ids": A + o1 + B, "sampling_params": GREEDY}).json()
    assert second["meta_info"]["prompt_tokens"] == len(A + o1 + B)
    assert second["output_ids"] == whole["output_ids"]
    # a streamed turn records its output too
    streamed = requests.post(
        url + "/generate",
        json={"input_ids": C, "sampling_params": GREEDY, "rid": "t3", "stream": True,
              "session_params": {"id": sid, "rid": "t2"}},
        timeout=30,
    )  # fmt: skip
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    fourth = _generate(url, {"input_ids": B, "sampling_params": GREEDY, "rid": "t4",
                             "session_params": {"id": sid, "rid": "t3"}}).json()  # fmt: skip
    o3 = _generate(url, {"input_ids": A + o1 + B + second["output_ids"] + C,
                         "sampling_params": GREEDY}).json()["output_ids"]  # fmt: skip
    prompt = A + o1 + B + second["output_ids"] + C + o3 + B
    assert fourth["meta_info"]["prompt_tokens"] == len(prompt)
    again_whole = _generate(url, {"input_ids": prompt, "sampling_params": GREEDY}).json()
    assert fourth["output_ids"] == again_whole["output_ids"]


@pytest.mark.timeout(120)
def test_session_refusals_are_sglangs_400s_and_a_closed_session_takes_nothing(url: str) -> None:
    sid = _open(url, session_id="named").json()
    assert sid == "named"
    again = _open(url, session_id="named")
    assert again.status_code == 400 and "still open" in again.json()["error"]["message"]
    streaming = _open(url, streaming=True)
    assert "--enable-streaming-session" in streaming.json()["error"]["message"]
    missing = requests.post(url + "/open_session", json={}, timeout=30)
    assert missing.status_code == 400 and "capacity_of_str_len" in missing.text
    cases = [
        ({"id": "nope"}, "Invalid request: session id nope does not exist"),
        ({"id": sid, "rid": "never"}, "Invalid request session id"),
        ({"id": sid, "offset": "2"}, "session_params.offset"),
        ({"id": sid, "bogus": 1}, "session_params.bogus"),
    ]
    for params, words in cases:
        answer = _generate(url, {"input_ids": A, "sampling_params": GREEDY,
                                 "session_params": params})  # fmt: skip
        assert answer.status_code == 400 and words in answer.json()["error"]["message"]
    two = _generate(url, {"input_ids": A, "session_params": {"id": sid},
                          "sampling_params": {**GREEDY, "n": 2}})  # fmt: skip
    assert two.status_code == 400
    # a neutral session_params (no id) is a plain request
    plain = _generate(url, {"input_ids": A, "sampling_params": GREEDY, "session_params": {}})
    assert plain.status_code == 200
    # a request refused after its prompt was composed leaves no trace in the session
    too_long = {**GREEDY, "max_new_tokens": 10**6}
    refused = _generate(url, {"input_ids": A, "rid": "r1", "sampling_params": too_long,
                              "session_params": {"id": sid}})  # fmt: skip
    assert refused.status_code == 400
    after = _generate(url, {"input_ids": B, "sampling_params": GREEDY,
                            "session_params": {"id": sid, "rid": "r1"}})  # fmt: skip
    assert after.json()["error"]["message"] == "Invalid request session id"
    closed = requests.post(url + "/close_session", json={"session_id": sid}, timeout=30)
    assert closed.status_code == 200 and closed.content == b""
    gone = _generate(url, {"input_ids": A, "sampling_params": GREEDY,
                           "session_params": {"id": sid}})  # fmt: skip
    assert gone.status_code == 400 and "does not exist" in gone.text


@pytest.mark.timeout(120)
def test_the_openai_routes_carry_session_params_to_the_session(url: str) -> None:
    """As SGLang's ``serving_completions`` and ``serving_chat`` pass ``session_params`` on: a
    ``/v1/completions`` turn (streamed too) continues the session's request, answering as the
    composed prompt sent whole; a refusal is the route's 400 with the session's words."""
    openai = OpenAI(base_url=url + "/v1", api_key="none")
    name = openai.models.list().data[0].id
    sid = _open(url).json()
    first = _generate(url, {"input_ids": A, "sampling_params": GREEDY, "rid": "v1",
                            "session_params": {"id": sid}}).json()  # fmt: skip
    turn = openai.completions.create(
        model=name, prompt=B, max_tokens=5, temperature=0,
        extra_body={"session_params": {"id": sid, "rid": "v1"}, "rid": "v2", "ignore_eos": True},
    )  # fmt: skip
    whole = _generate(url, {"input_ids": A + first["output_ids"] + B, "sampling_params": GREEDY,
                            "return_logprob": True}).json()  # fmt: skip
    assert turn.usage.prompt_tokens == len(A + first["output_ids"] + B)
    assert turn.choices[0].text == whole["text"]
    streamed = openai.completions.create(
        model=name, prompt=C, max_tokens=5, temperature=0, stream=True,
        extra_body={"session_params": {"id": sid, "rid": "v2"}, "rid": "v3", "ignore_eos": True},
    )  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    after = _generate(url, {"input_ids": B, "sampling_params": GREEDY,
                            "session_params": {"id": sid, "rid": "v3"}})  # fmt: skip
    assert after.status_code == 200  # the streamed turn is in the session
    with pytest.raises(BadRequestError, match="does not exist"):
        openai.completions.create(model=name, prompt=B, max_tokens=2,
                                  extra_body={"session_params": {"id": "nope"}})  # fmt: skip


@pytest.mark.timeout(120)
def test_a_streaming_session_on_the_engine_keeps_its_turns(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", seed=6)
    with builtin_engine(model, "--enable-streaming-session") as url:
        sid = _open(url, streaming=True).json()
        first = _generate(url, {"input_ids": A, "sampling_params": GREEDY,
                                "session_params": {"id": sid}}).json()  # fmt: skip
        second = _generate(url, {"input_ids": B, "sampling_params": GREEDY,
                                 "session_params": {"id": sid}}).json()  # fmt: skip
        prompt = A + first["output_ids"] + B
        whole = _generate(url, {"input_ids": prompt, "sampling_params": GREEDY}).json()
        assert second["meta_info"]["prompt_tokens"] == len(prompt)
        assert second["output_ids"] == whole["output_ids"]
        offset = _generate(url, {"input_ids": B, "sampling_params": GREEDY,
                                 "session_params": {"id": sid, "offset": 1}})  # fmt: skip
        assert offset.status_code == 400 and "do not support offset" in offset.text
