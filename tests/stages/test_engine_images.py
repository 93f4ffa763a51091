"""Images in prompts on a Qwen2-VL or Qwen2.5-VL model (``/generate``'s ``image_data``, the chat
route's ``image_url`` parts), as SGLang 0.5.23 serves them (``io_struct.GenerateReqInput.
_normalize_image_data``, ``utils/common.py`` ``load_image``, ``base_processor.load_mm_data``,
``qwen_vl.py`` ``QwenVLImageProcessor``, ``jinja_template_utils.process_content_for_template_
format``). Every answer is held to transformers' own greedy decoding of the model with its
processor (``tiny_vlm.hf_greedy``): the same tokens, log-probs within 1e-4."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from stages.engine.images import Vision, checkpoint_name, model_name
from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from stages.hf import AutoModelForImageTextToText, AutoTokenizer
from tests.stages.engine_setup import run_with_retraction
from tests.stages.test_engine_server import GREEDY, Engine, serving
from tests.stages.tiny_model import make_tiny_model
from tests.stages.tiny_vlm import (
    IMAGE_PAD_ID,
    IMAGE_TOKEN,
    data_uri,
    hf_greedy,
    hf_prompt_ids,
    hf_prompt_logprobs,
    image_png,
    make_qwen_vl,
)

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

STEPS = 8
SQUARE, WIDE = image_png(1), image_png(2, 112, 84)  # 4 and 12 image pads
TWO = (
    f"<|im_start|>user\nlook {IMAGE_TOKEN} and {IMAGE_TOKEN} now<|im_end|>\n<|im_start|>assistant\n"
)
ONE = f"<|im_start|>user\n{IMAGE_TOKEN} what is it?<|im_end|>\n<|im_start|>assistant\n"
PLAIN = "<|im_start|>user\nno picture here<|im_end|>\n<|im_start|>assistant\n"
TOLERANCE = 1e-4
# Qwen3.5's hybrid on transformers' passes (gated delta nets, experts): their kernels' float
# orders differ more between one prompt alone and a batched pass (1.3e-4 seen on AVX2 kernels)
HYBRID_TOLERANCE = 1e-3


@pytest.fixture(
    scope="module",
    params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"],
)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_qwen_vl(tmp_path_factory.mktemp(request.param) / "model", arch=request.param)
    _TOLERANCE[0] = HYBRID_TOLERANCE if _hybrid(path) else TOLERANCE
    return path


_TOLERANCE = [TOLERANCE]  # the model's at hand (model_dir's)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("vl-log") / "engine.log"
    with serving(model_dir, log, "--enable-lora") as eng:
        yield eng


def _body(prompt: Any, images: Any, **more: Any) -> dict[str, Any]:
    key = (
        "text"
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str))
        else "input_ids"
    )
    params = {**GREEDY, "max_new_tokens": STEPS, **more.pop("params", {})}
    return {
        key: prompt,
        "image_data": images,
        "sampling_params": params,
        "return_logprob": True,
        **more,
    }


def _answer(out: dict[str, Any]) -> tuple[list[int], list[float]]:
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < _TOLERANCE[0]


@pytest.mark.timeout(120)
def test_generate_with_images_answers_as_transformers(engine: Engine, model_dir: Path) -> None:
    """On the engine's own passes (``llama_forward``: the text model's, with its multimodal
    rotary positions and Qwen3-VL's deepstack rows; Qwen3-VL-MoE's experts by its own
    module): transformers' answers."""
    info = requests.get(engine.url + "/server_info", timeout=30).json()
    # Qwen3.5's linear-attention layers run on transformers' passes
    assert info["forward_path"] == ("transformers" if _hybrid(model_dir) else "fast"), info
    want = hf_greedy(model_dir, TWO, [SQUARE, WIDE], STEPS)
    images = [data_uri(SQUARE), data_uri(WIDE)]
    out = engine.generate(_body(TWO, images, return_prompt_token_ids=True))
    _same(_answer(out), want)
    expanded = hf_prompt_ids(model_dir, TWO, [SQUARE, WIDE])
    assert out["prompt_token_ids"] == expanded  # each image's pads: 4 and 12
    assert out["meta_info"]["prompt_tokens"] == len(expanded)
    # ids read as their text (load_mm_data): already expanded (as RL code sends them), or not
    unexpanded = AutoTokenizer.from_pretrained(model_dir).encode(TWO)
    for ids in (expanded, unexpanded):
        _same(_answer(engine.generate(_body(ids, images))), want)
    # the images matter: swapped, another answer; and none leak into the next prompt
    swapped = engine.generate(_body(TWO, images[::-1]))
    assert _answer(swapped) != _answer(out)
    plain = engine.generate(_body(PLAIN, None))
    _same(_answer(plain), hf_greedy(model_dir, PLAIN, [], STEPS))


@pytest.mark.timeout(120)
def test_the_forms_of_an_image_and_of_image_data(
    engine: Engine, model_dir: Path, tmp_path: Path
) -> None:
    """A path, a file:// URL, bare base64 and {"url"} read as the data URI does; a batch's
    image_data one entry a prompt (or one image for all), n > 1 each sample alike."""
    want = hf_greedy(model_dir, ONE, [WIDE], STEPS)
    path = tmp_path / "wide.png"
    path.write_bytes(WIDE)
    uri = data_uri(WIDE)
    for image in (str(path), f"file://{path}", uri.split(",", 1)[1], {"url": uri}, [uri]):
        _same(_answer(engine.generate(_body(ONE, image))), want)
    square = hf_greedy(model_dir, ONE, [SQUARE], STEPS)
    batch = engine.generate(
        _body([ONE, PLAIN, ONE], [[uri], None, data_uri(SQUARE)], params={"n": 2})
    )
    answers = [_answer(out) for out in batch]
    plain = hf_greedy(model_dir, PLAIN, [], STEPS)
    for got, expected in zip(answers, [want, want, plain, plain, square, square], strict=True):
        _same(got, expected)
    for out in engine.generate(_body([ONE, ONE], uri)):  # one image for every prompt
        _same(_answer(out), want)


SLOW_FETCH = 1.5  # seconds the image server below takes over /slow.png


class _ImageServer(http.server.BaseHTTPRequestHandler):
    """``/slow.png`` (WIDE, after SLOW_FETCH seconds) and ``/square.png``; else a 404."""

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(SLOW_FETCH)
            data = WIDE
        elif self.path == "/square.png":
            data = SQUARE
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.mark.timeout(120)
def test_http_images_are_fetched_off_the_event_loop(
    engine: Engine, model_dir: Path, image_server: str
) -> None:
    """An ``http(s)`` image is fetched on a worker thread while its request waits (SGLang's
    processor workers fetch it): a slow image server holds up its request only, a text
    request meanwhile is answered at once; through ``/generate``, its stream and the chat
    route's stream alike; one that is not there is a 400 naming its entry."""
    slow: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: slow.update(engine.generate(_body(ONE, image_server + "/slow.png")))
    )
    began = time.monotonic()
    thread.start()
    time.sleep(0.3)  # (the slow request in and waiting for its image)
    plain = engine.generate(_body(PLAIN, None))
    assert thread.is_alive() and time.monotonic() - began < SLOW_FETCH, "the loop waited"
    thread.join(60)
    _same(_answer(slow), hf_greedy(model_dir, ONE, [WIDE], STEPS))
    _same(_answer(plain), hf_greedy(model_dir, PLAIN, [], STEPS))
    want = hf_greedy(model_dir, ONE, [SQUARE], STEPS)
    url = image_server + "/square.png"
    body = {**_body(ONE, [url]), "stream": True}
    with requests.post(engine.url + "/generate", json=body, stream=True, timeout=60) as answer:
        events = [line for line in answer.iter_lines() if line.startswith(b"data: {")]
    assert json.loads(events[-1][6:])["output_ids"] == want[0]
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)

    def asked(image: str, **more: Any) -> Any:
        parts = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "?"}]
        return client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": parts}], max_tokens=STEPS,
            temperature=0, extra_body={"ignore_eos": True}, **more,
        )  # fmt: skip

    streamed = "".join(c.choices[0].delta.content or "" for c in asked(url, stream=True))
    assert streamed == asked(data_uri(SQUARE)).choices[0].message.content
    missing = requests.post(
        engine.url + "/generate", json=_body(ONE, image_server + "/gone.png"), timeout=30
    )
    assert missing.status_code == 400
    assert "image_data" in missing.text and "404" in missing.text, missing.text


@pytest.mark.timeout(120)
def test_chat_image_parts_go_to_the_model(engine: Engine, model_dir: Path) -> None:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    want = hf_greedy(model_dir, TWO, [SQUARE, WIDE], STEPS)
    content = [
        {"type": "text", "text": "look "},
        {"type": "image_url", "image_url": {"url": data_uri(SQUARE)}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": data_uri(WIDE)}},
        {"type": "text", "text": " now"},
    ]
    answer = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], max_tokens=STEPS,
        temperature=0, logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    lps = [entry.logprob for entry in answer.choices[0].logprobs.content]
    assert max(abs(a - b) for a, b in zip(lps, want[1], strict=True)) < _TOLERANCE[0]
    assert answer.usage.prompt_tokens == len(hf_prompt_ids(model_dir, TWO, [SQUARE, WIDE]))
    streamed = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], max_tokens=STEPS,
        temperature=0, stream=True, n=1, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == answer.choices[0].message.content
    # the Responses API's input_image parts, through the chat route (no ignore_eos there)
    plain = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], max_tokens=STEPS,
        temperature=0,
    )  # fmt: skip
    parts = [
        {"type": "input_image", "image_url": p["image_url"]["url"]}
        if p["type"] == "image_url"
        else {"type": "input_text", "text": p["text"]}
        for p in content
    ]
    response = client.responses.create(
        model=client.models.list().data[0].id, input=[{"role": "user", "content": parts}],
        max_output_tokens=STEPS + 2, temperature=0,  # (SGLang keeps 2 tokens back)
    )  # fmt: skip
    assert response.output_text and response.output_text == plain.choices[0].message.content
    # Anthropic's /v1/messages: image blocks as image_url parts (base64 source)
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": p["image_url"]["url"].split(",", 1)[1]}}
        if p["type"] == "image_url"
        else p
        for p in content
    ]  # fmt: skip
    status, message = engine.request("POST", "/v1/messages", {
        "model": "default", "max_tokens": STEPS, "temperature": 0,
        "messages": [{"role": "user", "content": blocks}],
    })  # fmt: skip
    assert status == 200, message
    assert message["content"][0]["text"] == plain.choices[0].message.content
    two = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], max_tokens=STEPS,
        temperature=0, n=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.message.content for c in two.choices] == [answer.choices[0].message.content] * 2


@pytest.mark.timeout(120)
def test_what_cannot_be_read_is_a_400_naming_the_field(engine: Engine) -> None:
    uri = data_uri(SQUARE)
    cases = [
        (_body(TWO, [uri]), "image_data", "2 image token(s)"),
        (_body(PLAIN, uri), "image_data", "0 image token(s)"),
        (_body(ONE, "not base64!"), "image_data[0]", "Could not read image"),
        (_body(ONE, "data:image/png;base64,aGVsbG8="), "image_data[0]", "Could not decode"),
        (_body(ONE, 7), "image_data[0]", "Invalid image"),
        # a header that reads and pixels that do not (found by the worker that decodes them)
        (_body(ONE, data_uri(WIDE[:120])), "image_data[0]", "Could not decode image"),
        (_body(ONE, data_uri(WIDE[:120]), stream=True), "image_data[0]", "Could not decode"),
        (_body(ONE, "/nonexistent/x.png"), "image_data[0]", "Could not read image"),
        (_body([ONE, ONE], [uri]), "image_data", "equal to the batch size"),
        (_body([ONE, ONE], [[uri], [uri, uri]]), "image_data[1]", "1 image token(s)"),
    ]
    for body, field, words in cases:
        status, out = engine.request("POST", "/generate", body)
        assert status == 400, (body, out)
        assert field in str(out) and words in str(out), out
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=r"image_url\.url"):
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        )
    assert engine.request("GET", "/health")[0] == 200


@pytest.mark.timeout(120)
def test_a_sessions_turns_carry_their_images_on(engine: Engine, model_dir: Path) -> None:
    """A session's turn holds its history's images, then its own (SGLang's session carries a
    request's ``multimodal_inputs`` on, ``session_controller.create_req``; its own offsets
    moved past the history, ``adjust_mm_offsets``); the history is the ids the model ran, so
    its KV is reused; an ``offset`` keeps the images before it and one that cuts an image
    is a 400; each turn answers as transformers does the composed conversation's ids (the
    byte tokenizer's decoding of an answer does not encode back to it)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    status, session = engine.request("POST", "/open_session", {"capacity_of_str_len": 1000})
    assert status == 200, session

    def turn(text: str, images: Any, **params: Any) -> tuple[int, Any]:
        body = _body(text, images, session_params={"id": session, **params})
        return engine.request("POST", "/generate", body)

    status, first = turn(ONE, data_uri(WIDE), rid=None)
    assert status == 200, first
    _same(_answer(first), hf_greedy(model_dir, ONE, [WIDE], STEPS))
    then = f"<|im_end|>\n<|im_start|>user\nand {IMAGE_TOKEN}?<|im_end|>\n<|im_start|>assistant\n"
    status, second = turn(then, [data_uri(SQUARE)], rid=first["meta_info"]["id"])
    assert status == 200, second
    ran = hf_prompt_ids(model_dir, ONE, [WIDE])
    square = hf_prompt_ids(model_dir, IMAGE_TOKEN, [SQUARE])  # its pads, with their ends
    then_ids = tokenizer.encode(then.replace(IMAGE_TOKEN, "\0"))  # (one byte for the image)
    at = then_ids.index(0)
    whole = ran + first["output_ids"] + then_ids[:at] + square + then_ids[at + 1 :]
    _same(_answer(second), hf_greedy(model_dir, "", [WIDE, SQUARE], STEPS, ids=whole))
    meta = second["meta_info"]
    assert meta["prompt_tokens"] == len(whole)
    assert meta["cached_tokens"] >= len(ran)
    # an offset that keeps the first turn's prompt: its image, none of the second's
    status, third = turn("more", None, rid=second["meta_info"]["id"], offset=len(ran))
    assert status == 200, third
    _same(_answer(third), hf_greedy(model_dir, ONE + "more", [WIDE], STEPS))
    # one that ends inside the first image
    pads = hf_prompt_ids(model_dir, ONE, [WIDE]).index(IMAGE_PAD_ID)
    status, out = turn("more", None, rid=second["meta_info"]["id"], offset=pads + 2)
    assert status == 400 and "ends inside image 0" in str(out), out


@pytest.mark.timeout(120)
def test_a_lora_adapter_on_the_text_model_answers_as_its_merged_model(
    engine: Engine, model_dir: Path, tmp_path: Path
) -> None:
    """A peft adapter of the text model's projections (named as transformers 5 names them,
    ``model.language_model.layers.N``) is applied unmerged to the rows that name it, image
    prompts too: transformers' answer of the merged model (Qwen3-VL-MoE's too, whose experts
    it leaves alone); one that targets the vision tower is refused naming its key."""
    from peft import LoraConfig, get_peft_model

    def adapter(name: str, targets: str) -> Any:
        base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for key, param in peft.named_parameters():
                if "lora_" in key:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        peft.save_pretrained(tmp_path / name)
        return peft

    def load(name: str) -> tuple[int, Any]:
        body = {"lora_name": name, "lora_path": str(tmp_path / name)}
        return engine.request("POST", "/load_lora_adapter", body)

    peft = adapter("text", r".*language_model.*\.(q_proj|v_proj|down_proj)")
    if _hybrid(model_dir):  # adapters need the engine's own passes (README: hybrids take none)
        status, out = load("text")
        assert status == 400 and "forward path" in out["error_message"], out
        return
    merged = tmp_path / "merged"
    peft.merge_and_unload().save_pretrained(merged)
    for file in model_dir.iterdir():  # its tokenizer and processor
        if not file.name.startswith("model") and not (merged / file.name).exists():
            (merged / file.name).write_bytes(file.read_bytes())
    status, out = load("text")
    assert status == 200, out
    images = [data_uri(SQUARE), data_uri(WIDE)]
    want = hf_greedy(merged, TWO, [SQUARE, WIDE], STEPS)
    assert want[0] != hf_greedy(model_dir, TWO, [SQUARE, WIDE], STEPS)[0]  # it changes them
    _same(_answer(engine.generate(_body(TWO, images, lora_path="text"))), want)
    batch = engine.generate(_body([TWO, TWO], [images, images], lora_path=[None, "text"]))
    _same(_answer(batch[0]), hf_greedy(model_dir, TWO, [SQUARE, WIDE], STEPS))
    _same(_answer(batch[1]), want)
    adapter("tower", r".*visual.*\.(qkv|proj)")
    status, out = load("tower")
    assert status == 400 and "visual" in str(out), out
    assert engine.request("POST", "/unload_lora_adapter", {"lora_name": "text"})[0] == 200


@pytest.mark.timeout(120)
def test_a_text_model_refuses_images(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "text", vocab=64)
    with serving(model, tmp_path / "engine.log") as eng:
        status, out = eng.request("POST", "/generate", _body([5, 6, 7], data_uri(SQUARE)))
        assert status == 400 and "image_data" in str(out), out


@pytest.mark.timeout(120)
def test_images_in_one_batch_with_text_and_a_retraction(model_dir: Path) -> None:
    """A prefill that holds an image prompt beside a text one, decode steps whose rows move on
    by different rotary deltas, and a retraction that runs the image prompt again: each sample
    ends as transformers' alone."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    vision = Vision(model_dir, model, AutoTokenizer.from_pretrained(model_dir))
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
    want = [
        hf_greedy(model_dir, TWO, [SQUARE, WIDE], STEPS),
        hf_greedy(model_dir, PLAIN, [], STEPS),
    ]
    for retract in (False, True):
        scheduler = Scheduler(model, max_running=4)
        ids, image = vision.prompt(TWO, None, [data_uri(SQUARE), data_uri(WIDE)], "image_data")
        plain = vision.tokenizer.encode(PLAIN)
        futures = [
            scheduler.submit(GenerateInput("i", ids, params, True, images=image)),
            scheduler.submit(GenerateInput("p", plain, params, True)),
        ]
        run_with_retraction(scheduler, 3, retract)
        for future, expected in zip(futures, want, strict=True):
            result = future.result(timeout=0)
            _same((result.output_ids, result.output_token_logprobs), expected)
            if future is futures[0]:  # a retraction finds its prompt's KV in the cache
                assert (result.cached_tokens > 0) == retract


@pytest.mark.timeout(120)
def test_weight_updates_take_either_naming(engine: Engine, model_dir: Path, tmp_path: Path) -> None:
    """``/update_weights_from_disk`` reads a checkpoint whose tensors have the original
    checkpoints' names (``visual.``, ``model.layers.``: what transformers 5 saves, and SGLang's
    mapper takes both) or transformers 5's module names (``model.visual.``,
    ``model.language_model.``); ``/get_weights_by_name`` takes either name; the answers are
    then the new weights' (vision tower included)."""
    other = make_qwen_vl(tmp_path / "other", arch=_arch(model_dir), seed=9)
    want = hf_greedy(other, TWO, [SQUARE, WIDE], STEPS)
    tensors = load_file(other / "model.safetensors")  # transformers 5 saves Qwen2(.5)-VL's
    original = any(name.startswith("visual.") for name in tensors)  # as the original ones
    # Qwen3-VL's and Qwen3.5's: their modules' names
    assert original == (not _arch(model_dir).startswith(("qwen3_vl", "qwen3_5")))
    renamed = tmp_path / "other-names"
    renamed.mkdir()
    other_name = model_name if original else checkpoint_name
    save_file({other_name(k): v for k, v in tensors.items()}, renamed / "model.safetensors")
    tensors = {checkpoint_name(k): v for k, v in tensors.items()}
    images = [data_uri(SQUARE), data_uri(WIDE)]
    name = "visual.blocks.0.attn.qkv.weight"
    try:
        for folder in (other, renamed):
            status, out = engine.request(
                "POST", "/update_weights_from_disk", {"model_path": str(model_dir)}
            )
            assert status == 200 and out["success"], out
            status, out = engine.request(
                "POST", "/update_weights_from_disk", {"model_path": str(folder)}
            )
            assert status == 200 and out["success"], out
            _same(_answer(engine.generate(_body(TWO, images))), want)
        for asked in (name, "model." + name):
            status, rows = engine.request(
                "POST", "/get_weights_by_name", {"name": asked, "truncate_size": 2}
            )
            assert status == 200, rows
            assert torch.allclose(torch.tensor(rows), tensors[name][:2], atol=1e-6)
    finally:
        status, out = engine.request(
            "POST", "/update_weights_from_disk", {"model_path": str(model_dir)}
        )
        assert status == 200 and out["success"], out
    _same(
        _answer(engine.generate(_body(TWO, images))),
        hf_greedy(model_dir, TWO, [SQUARE, WIDE], STEPS),
    )


def _arch(model_dir: Path) -> str:
    return json.loads((model_dir / "config.json").read_text())["model_type"]


def _hybrid(model_dir: Path) -> bool:
    """Qwen3.5: linear-attention layers, whose states the prefix cache keeps only where a
    context or a sequence ended (``test_a_hybrids_next_turn_with_its_image_goes_on_from_its_
    states`` instead of the prefix tests of attention's KV)."""
    return _arch(model_dir).startswith("qwen3_5")


@pytest.mark.timeout(120)
def test_an_abort_while_the_pixels_are_made_aborts_the_request(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request waits off the event loop while a worker makes its images' pixels (the
    loop serves on: ``/health`` answers); an abort meanwhile ends it as an abort while its
    grammar compiles ends (``ABORTED_COMPILING``: 400 ``Aborted by AbortReq.``)."""
    from aiohttp.test_utils import TestClient, TestServer

    from stages.engine.loader import load_model
    from stages.engine.server import build_app

    loaded = load_model(str(model_dir), device="cpu")
    vision = loaded.vision
    make, making, release = vision._pixel_values, threading.Event(), threading.Event()

    def slow(*args: Any) -> Any:
        making.set()
        assert release.wait(10)
        return make(*args)

    monkeypatch.setattr(vision, "_pixel_values", slow)
    scheduler = Scheduler(loaded.model, max_running=4)
    scheduler.start()

    async def main() -> None:
        async with TestClient(TestServer(build_app(loaded, scheduler))) as client:
            body = _body(ONE, data_uri(SQUARE), rid="r")
            sent = asyncio.ensure_future(client.post("/generate", json=body))
            assert await asyncio.to_thread(making.wait, 5)
            assert (await client.get("/health")).status == 200  # the loop serves on
            answer = await client.post("/abort_request", json={"rid": "r"})
            assert answer.status == 200
            release.set()
            response = await sent
            assert response.status == 400, await response.text()
            assert json.loads(await response.read()) == {
                "error": {"message": "Aborted by AbortReq."}
            }
            release.clear()  # and one not aborted is served once its pixels are made
            sent = asyncio.ensure_future(client.post("/generate", json={**body, "rid": "s"}))
            assert await asyncio.to_thread(making.wait, 5)
            release.set()
            response = await sent
            assert response.status == 200
            want = hf_greedy(model_dir, ONE, [SQUARE], STEPS)
            _same(_answer(await response.json()), want)

    try:
        asyncio.run(main())
    finally:
        release.set()
        scheduler.stop()


@pytest.mark.timeout(120)
def test_an_image_found_unreadable_before_its_request_is_queued_is_refused(
    model_dir: Path,
) -> None:
    """Pixels that fail before the request reaches the scheduler (the worker was quick) refuse
    it where it is submitted, on the loop or off it, and no step fails (the engine fuzz found
    this race: the failure reached the prefill, a failed step for every request in flight)."""
    from stages.engine.request_error import RequestError

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    vision = Vision(model_dir, model, AutoTokenizer.from_pretrained(model_dir))
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
    scheduler = Scheduler(model, max_running=4)
    plain = scheduler.submit(GenerateInput("p", vision.tokenizer.encode(PLAIN), params, True))
    for rid in ("sync", "async"):
        ids, image = vision.prompt(ONE, None, [data_uri(WIDE[:120])], "image_data")
        with pytest.raises(RequestError, match="Could not decode image"):
            image.pixels.result(timeout=10)
        inp = GenerateInput(rid, ids, params, True, images=image)
        with pytest.raises(RequestError, match=r"image_data\[0\]: Could not decode image"):
            if rid == "sync":
                scheduler.submit(inp)
            else:

                async def submit(inp: GenerateInput = inp) -> None:
                    await scheduler.submit_async([inp])

                asyncio.run(submit())
    scheduler.run_until_idle()
    result = plain.result(timeout=0)
    _same((result.output_ids, result.output_token_logprobs), hf_greedy(model_dir, PLAIN, [], STEPS))


@pytest.mark.timeout(120)
def test_image_prompts_share_the_prefix_cache_by_their_images(
    engine: Engine, model_dir: Path
) -> None:
    """An image prompt's KV goes to the prefix cache with its pads keyed by their image's
    content, as SGLang's radix cache keys them by the image's hash (``pad_value``): the same
    prompt again reuses all but its last token, another image only the text before it, the
    next turn of a conversation with the same image its whole first turn; and a scoring
    request whose cached prefix ends inside the image (its ``logprob_start_len`` there)
    computes the rest of the pads alone, its log-probs transformers' (Qwen3-VL's deepstack
    too)."""
    if _hybrid(model_dir):
        pytest.skip("a hybrid's prefix cache keeps states where contexts end: see _hybrid")
    ids = AutoTokenizer.from_pretrained(model_dir)
    assert requests.post(engine.url + "/flush_cache", timeout=30).status_code == 200
    uri = data_uri(WIDE)
    want = hf_greedy(model_dir, ONE, [WIDE], STEPS)
    first = engine.generate(_body(ONE, uri))
    again = engine.generate(_body(ONE, uri))
    prompt = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == prompt - 1
    _same(_answer(again), want)
    other = engine.generate(_body(ONE, data_uri(SQUARE)))
    first_pad = hf_prompt_ids(model_dir, ONE, [SQUARE]).index(IMAGE_PAD_ID)
    assert other["meta_info"]["cached_tokens"] == first_pad  # the text before the image
    _same(_answer(other), hf_greedy(model_dir, ONE, [SQUARE], STEPS))
    # the next turn: the first turn's text and answer, then more
    turn = ONE + ids.decode(first["output_ids"]) + "<|im_end|>\n<|im_start|>user\nand?"
    followed = engine.generate(_body(turn, uri))
    assert followed["meta_info"]["cached_tokens"] >= prompt
    _same(_answer(followed), hf_greedy(model_dir, turn, [WIDE], STEPS))
    # scored from inside the image: a cached prefix that ends at one of its pads
    expanded = hf_prompt_ids(model_dir, turn, [WIDE])
    pads = [i for i, t in enumerate(expanded) if t == IMAGE_PAD_ID]
    start = pads[len(pads) // 2]
    scored = engine.generate(
        {"text": turn, "image_data": uri, "sampling_params": {"max_new_tokens": 0},
         "return_logprob": True, "logprob_start_len": start}
    )  # fmt: skip
    meta = scored["meta_info"]
    assert 0 < meta["cached_tokens"] <= start
    logprobs = [lp for lp, _, _ in meta["input_token_logprobs"]]
    reference = hf_prompt_logprobs(model_dir, turn, [WIDE])
    assert logprobs[0] is None and len(logprobs) == len(expanded) - start
    apart = [abs(a - b) for a, b in zip(logprobs[1:], reference[start:], strict=True)]
    assert max(apart) < _TOLERANCE[0]


@pytest.mark.timeout(120)
def test_prompts_share_the_prefix_cache_up_to_the_first_image_that_differs(
    engine: Engine, model_dir: Path
) -> None:
    """Two images of one size (the same ids): a prompt whose first image is another's
    reuses that one's KV up to its second image, another first image only the text before
    it, and the same image twice is keyed alike at both places (SGLang keys each image's
    pads by its own hash); every answer transformers'."""
    if _hybrid(model_dir):
        pytest.skip("a hybrid's prefix cache keeps states where contexts end: see _hybrid")
    assert requests.post(engine.url + "/flush_cache", timeout=30).status_code == 200
    other = image_png(3)  # SQUARE's size, other pixels
    expanded = hf_prompt_ids(model_dir, TWO, [SQUARE, other])
    assert expanded == hf_prompt_ids(model_dir, TWO, [other, SQUARE])
    pads = [i for i, t in enumerate(expanded) if t == IMAGE_PAD_ID]
    second = pads[len(pads) // 2]  # the second image's first pad (the two alike in size)
    first = engine.generate(_body(TWO, [data_uri(SQUARE), data_uri(other)]))
    assert first["meta_info"]["cached_tokens"] == 0
    for pictures, shared in (([SQUARE, SQUARE], second), ([other, SQUARE], pads[0])):
        out = engine.generate(_body(TWO, [data_uri(p) for p in pictures]))
        assert out["meta_info"]["cached_tokens"] == shared
        _same(_answer(out), hf_greedy(model_dir, TWO, pictures, STEPS))
    again = engine.generate(_body(TWO, [data_uri(SQUARE), data_uri(SQUARE)]))
    assert again["meta_info"]["cached_tokens"] == len(expanded) - 1


@pytest.mark.timeout(120)
def test_a_hybrids_next_turn_with_its_image_goes_on_from_its_states(
    engine: Engine, model_dir: Path
) -> None:
    """Qwen3.5: a conversation's next turn (its first turn's ids and answer, then more) with the
    same image goes on from the states its first turn's row left at its end (all but what
    follows and the last answer token, whose state was never computed); with another image
    of the same size (the same ids) it shares nothing, the image's pads keyed by its content;
    every answer transformers'."""
    if not _hybrid(model_dir):
        pytest.skip("attention's KV: the prefix tests above")
    assert requests.post(engine.url + "/flush_cache", timeout=30).status_code == 200
    prompt = hf_prompt_ids(model_dir, ONE, [SQUARE])
    first = engine.generate(_body(prompt, data_uri(SQUARE)))
    assert first["meta_info"]["cached_tokens"] == 0
    more = AutoTokenizer.from_pretrained(model_dir).encode("<|im_end|>\n<|im_start|>user\nand?")
    turn = [*prompt, *first["output_ids"], *more]
    for picture, cached in ((image_png(3), 0), (SQUARE, len(turn) - len(more) - 1)):
        out = engine.generate(_body(turn, data_uri(picture)))
        assert out["meta_info"]["cached_tokens"] == cached, picture == SQUARE
        _same(_answer(out), hf_greedy(model_dir, "", [picture], STEPS, ids=turn))
    # a prompt with its image scored (max_new_tokens 0): transformers' log-probs
    scored = engine.generate(
        {"text": ONE, "image_data": data_uri(SQUARE), "sampling_params": {"max_new_tokens": 0},
         "return_logprob": True, "logprob_start_len": 0}
    )  # fmt: skip
    logprobs = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"]]
    reference = hf_prompt_logprobs(model_dir, ONE, [SQUARE])
    assert logprobs[0] is None and len(logprobs) == len(prompt)
    assert max(abs(a - b) for a, b in zip(logprobs[1:], reference, strict=True)) < _TOLERANCE[0]
