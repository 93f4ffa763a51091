"""The tiny Qwen-VL checkpoints of ``tiny_vlm`` load offline, expand their images' tokens and
answer greedily in a way that depends on the images."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
from transformers.utils import is_torchvision_available

from tests.stages.tiny_vlm import (
    EOS_ID,
    IMAGE_PAD_ID,
    IMAGE_TOKEN,
    SPECIAL_TOKENS,
    VOCAB,
    _inputs,
    _model,
    _processor,
    hf_greedy,
    hf_prompt_ids,
    image_png,
    image_tokens,
    load_processor,
    make_qwen_vl,
)

ARCHS = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
}


def _image(png: bytes) -> Image.Image:
    """``png`` as an RGB PIL image."""
    return Image.open(io.BytesIO(png)).convert("RGB")


def _prompt(images: int, words: str = "w3 w5 w7") -> str:
    """A chat prompt of ``words`` after ``images`` image tokens, opening the answer."""
    return f"<|im_start|>user\n{IMAGE_TOKEN * images}{words}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_checkpoint_loads_and_expands_images(tmp_path, arch):
    path = make_qwen_vl(tmp_path / arch, arch=arch)
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert type(model).__name__ == ARCHS[arch][0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(256, VOCAB))
    assert config.text_config.vocab_size == len(tokenizer) == VOCAB
    names = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    assert tokenizer.convert_tokens_to_ids(names) == [
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    ]
    for where in (config, config.text_config):
        assert (where.eos_token_id, where.pad_token_id) == (
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
    assert tokenizer.encode("w3 w5 w7") == list(b"w3 w5 w7")  # a token per byte
    assert tokenizer.decode(tokenizer.encode("any text, é\n")) == "any text, é\n"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == _prompt(1, "hi")

    grids = AutoImageProcessor.from_pretrained(path)(
        [_image(image_png(1)), _image(image_png(2, 112, 84))], return_tensors="pt"
    )["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 4], [1, 6, 8]]
    processor = load_processor(path)
    assert ARCHS[arch][1] in [c.__name__ for c in type(processor).__mro__]
    ids = hf_prompt_ids(path, _prompt(2), [image_png(1), image_png(2, 112, 84)])
    assert ids.count(IMAGE_PAD_ID) == image_tokens(56, 56) + image_tokens(112, 84) == 4 + 12
    if is_torchvision_available():
        from transformers import AutoProcessor

        assert type(AutoProcessor.from_pretrained(path)).__name__ == ARCHS[arch][1]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_reference_depends_on_the_images(tmp_path, arch):
    path = make_qwen_vl(tmp_path / arch, arch=arch)
    steps, second = 6, image_png(7, 112, 84)
    tokens, logprobs = hf_greedy(path, _prompt(2), [image_png(1), second], steps)
    assert len(tokens) == len(logprobs) == steps
    assert all(-30.0 < lp <= 0.0 for lp in logprobs)
    assert hf_greedy(path, _prompt(2), [image_png(1), second], steps) == (tokens, logprobs)
    other = hf_greedy(path, _prompt(2), [image_png(2), second], steps)
    assert (
        other[0] != tokens
        or max(abs(a - b) for a, b in zip(other[1], logprobs, strict=True)) > 1e-3
    )
    assert len(hf_greedy(path, _prompt(0), [], steps)[0]) == steps  # text alone too

    # the cached loop is what transformers' own generate() does, up to an end of text
    model = _model(path)
    model.model.rope_deltas = None
    inputs = _inputs(_processor(path), _prompt(2), [image_png(1), second])
    out = model.generate(**inputs, do_sample=False, max_new_tokens=steps, output_logits=True,
                         return_dict_in_generate=True)  # fmt: skip
    new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    assert new == tokens[: len(new)] and (len(new) == steps or new[-1] == EOS_ID)
    for logits, token, logprob in zip(out.logits, new, logprobs[: len(new)], strict=True):
        assert float(torch.log_softmax(logits[0], -1)[token]) == pytest.approx(logprob, abs=1e-4)
