"""A tiny random Qwen2.5-VL, Qwen2-VL or Qwen3-VL checkpoint, saved to a directory, and
transformers' greedy answers for it as the reference an engine's images are checked against.

``make_qwen_vl(path)`` writes the config, seeded random weights, a byte-level tokenizer (token
``i`` < 256 is the byte ``i``, so plain text is its bytes; then Qwen's special tokens, from
``<|endoftext|>`` = 256 on), the chat template and a small image processor (56x56 pixels up to
112x112: a 56x56 image is 4 image tokens), so that ``AutoModelForImageTextToText``,
``AutoTokenizer`` and ``AutoImageProcessor`` load it offline. ``image_png`` makes an image,
``hf_greedy`` decodes greedily with transformers itself. Nothing here is a good model.

Transformers 5.25 builds no Qwen-VL processor without torchvision (its ``Qwen2VLVideoProcessor``
needs it, and the processor checks each part's class against a video class it cannot import);
``load_processor`` then builds the same processor class without a video processor.
"""

from __future__ import annotations

import base64
import functools
import io
import random
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLConfig,
    Qwen2VLProcessor,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
    Qwen3VLProcessor,
)

from tests.stages.tiny_model import _save_random

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_ID",
    "IMAGE_PAD_ID",
    "IMAGE_TOKEN",
    "MAX_PIXELS",
    "MIN_PIXELS",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "VOCAB",
    "data_uri",
    "hf_greedy",
    "hf_prompt_ids",
    "hf_prompt_logprobs",
    "image_png",
    "image_tokens",
    "load_processor",
    "make_qwen_vl",
]

# after the 256 bytes, in this order: ids 256..262
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # fmt: skip
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = (
    range(256, 256 + len(SPECIAL_TOKENS))
)
EOS_ID, PAD_ID, BOS_ID = IM_END_ID, ENDOFTEXT_ID, ENDOFTEXT_ID  # as Qwen2-VL-Instruct's
VOCAB = 256 + len(SPECIAL_TOKENS)
IMAGE_TOKEN = "<|vision_start|><|image_pad|><|vision_end|>"  # one image, before expansion
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112  # the image processor's bounds
MERGE = 2  # spatial_merge_size: one image token per 2x2 patches of 14x14 pixels

# Qwen2-VL's chat template without its default system prompt (and without vision ids)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_ARCHS: dict[str, tuple[Any, Any]] = {
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLProcessor),
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLProcessor),
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLProcessor),
    "qwen3_vl_moe": (Qwen3VLMoeConfig, Qwen3VLProcessor),
    "qwen3_5": (Qwen3_5Config, Qwen3VLProcessor),
    "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3VLProcessor),
}
PATCH = {"qwen2_5_vl": 14, "qwen2_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16, "qwen3_5": 16,
         "qwen3_5_moe": 16}  # patch sides  # fmt: skip


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet (the characters byte-level BPE writes bytes as)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    chars = [*printable, *(256 + i for i in range(len(rest)))]
    return {b: chr(c) for b, c in zip([*printable, *rest], chars, strict=True)}


def _tokenizer() -> Qwen2Tokenizer:
    """Qwen2's tokenizer class over the 256 bytes (id = byte, no merges) and the special
    tokens, with the chat template."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab.update({token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)})
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", model_max_length=512,
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _config(arch: str, text_sizes: dict[str, Any], vision_sizes: dict[str, Any]) -> Any:
    """The tiny configuration of ``arch`` (``qwen2_5_vl``, ``qwen2_vl`` or ``qwen3_vl``), with
    ``text_sizes`` and ``vision_sizes`` over its text and vision fields."""
    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    text = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},  # head_dim 8: sums to 4
        dtype="float32", **ids,
    )  # fmt: skip
    vision: dict[str, Any] = dict(
        depth=2, num_heads=2, patch_size=14, spatial_merge_size=MERGE, temporal_patch_size=2
    )
    if arch == "qwen2_5_vl":
        # window 56 pixels: 2x2 merged patches, so a 112x84 image has several windows
        vision.update(hidden_size=16, intermediate_size=32, out_hidden_size=32,
                      fullatt_block_indexes=[1], window_size=56)  # fmt: skip
    elif arch.startswith("qwen3_vl"):
        # 16-pixel patches; both vision blocks' features added to the first two text layers
        # (deepstack); a 4x4 table of position embeddings, interpolated to each grid
        vision.update(patch_size=16, hidden_size=16, intermediate_size=32, out_hidden_size=32,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 1])  # fmt: skip
        text.pop("rope_scaling")
        text.update(head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                    "mrope_section": [2, 1, 1], "mrope_interleaved": True})  # fmt: skip
        if arch == "qwen3_vl_moe":  # 4 experts of 16, 2 a token, in every layer
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        decoder_sparse_step=1)  # fmt: skip
    elif arch.startswith("qwen3_5"):
        # Qwen3.5: Qwen3-VL's tower without deepstack; a hybrid text model (three gated delta
        # nets, then a gated full attention) with interleaved mrope on a quarter of each head
        vision.update(patch_size=16, hidden_size=16, intermediate_size=32, out_hidden_size=32,
                      num_position_embeddings=16)  # fmt: skip
        text.pop("rope_scaling")
        text.update(head_dim=16, num_hidden_layers=4, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4, tie_word_embeddings=False,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                     "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True})  # fmt: skip
        if arch == "qwen3_5_moe":  # 4 experts of 16, 2 a token, and a shared one
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16)  # fmt: skip
    else:
        vision.update(embed_dim=16, mlp_ratio=2, hidden_size=32)  # hidden_size: the output
    config_class = _ARCHS[arch][0]
    return config_class(
        text_config={**text, **text_sizes}, vision_config={**vision, **vision_sizes},
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID, dtype="float32", **ids,
    )  # fmt: skip


def make_qwen_vl(
    path: Path,
    *,
    arch: str = "qwen2_5_vl",
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    max_pixels: int = MAX_PIXELS,
) -> Path:
    """Save a random tiny ``Qwen2_5_VLForConditionalGeneration`` (``arch`` ``qwen2_5_vl``) or
    ``Qwen2VLForConditionalGeneration`` (``qwen2_vl``) or ``Qwen3VLForConditionalGeneration``
    (``qwen3_vl``: 16-pixel patches, deepstack into both text layers; ``qwen3_vl_moe``: the same
    with 4 experts a layer), its tokenizer, chat
    template and image
    processor under ``path``; returns ``path``. Text: hidden 32, 2 layers, 4 heads (2 kv) of 8,
    mrope sections ``[2, 1, 1]``; vision: 2 blocks of hidden 16, patches 14, merge 2 (``text``
    and ``vision``: other values of their config fields, for a bench's larger model;
    ``max_pixels``: the image processor's upper bound)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if arch not in _ARCHS:
        raise ValueError(f"arch {arch!r}: one of {sorted(_ARCHS)}")
    config = _config(arch, text or {}, vision or {})
    path = _save_random(AutoModelForImageTextToText, config, Path(path), seed)
    _tokenizer().save_pretrained(path)  # tokenizer files and chat_template.jinja
    patch = {"patch_size": PATCH[arch], "merge_size": MERGE}
    if arch.startswith(("qwen3_vl", "qwen3_5")):  # (Qwen3-VL's normalization)
        patch.update(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    pixels = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=max_pixels, **patch)
    pixels.save_pretrained(path)
    return path


def image_png(seed: int, width: int = 56, height: int = 56) -> bytes:
    """A ``width`` x ``height`` RGB PNG of random pixels, the same for the same seed."""
    from PIL import Image

    pixels = random.Random(seed).randbytes(width * height * 3)
    out = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(out, format="PNG")
    return out.getvalue()


def data_uri(png: bytes) -> str:
    """``png`` as a ``data:image/png;base64,...`` URI."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_tokens(width: int, height: int) -> int:
    """How many ``<|image_pad|>`` one ``width`` x ``height`` image expands to (its resized
    14-pixel patch grid over 2x2: 4 for 56x56, 12 for 112x84)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return (h // 14) * (w // 14) // MERGE**2


def load_processor(path: Path) -> Any:
    """The Qwen-VL processor of the model at ``path``: ``AutoProcessor``'s where torchvision is
    installed; without it, the same class (``Qwen2_5_VLProcessor`` or ``Qwen2VLProcessor``)
    built from ``AutoTokenizer`` and ``AutoImageProcessor``, with no video processor."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(path)
    base = _ARCHS[AutoConfig.from_pretrained(path).model_type][1]

    class WithoutVideo(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None  # the check would import the video processor's class
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(path)
    return WithoutVideo(
        image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=tokenizer,
        video_processor=None, chat_template=tokenizer.chat_template,
    )  # fmt: skip


@functools.lru_cache(maxsize=8)
def _model(path: Path) -> Any:
    """The model at ``path`` (float32, eval), loaded once."""
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=8)
def _processor(path: Path) -> Any:
    """``load_processor(path)``, loaded once."""
    return load_processor(path)


def _inputs(processor: Any, text: str, images: list[bytes]) -> dict[str, torch.Tensor]:
    """The processor's tensors for ``text`` with ``images`` (PNG or other bytes)."""
    from PIL import Image

    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    return dict(processor(text=[text], images=pictures or None, return_tensors="pt"))


def hf_prompt_ids(path: Path, text: str, images: list[bytes]) -> list[int]:
    """The processor's ``input_ids`` for ``text`` (one ``IMAGE_TOKEN`` per image), each
    image's ``<|image_pad|>`` expanded to its grid."""
    return _inputs(_processor(Path(path)), text, images)["input_ids"][0].tolist()


@torch.no_grad()
def hf_prompt_logprobs(path: Path, text: str, images: list[bytes]) -> list[float]:
    """Transformers' log-probability of each prompt token after the first given those before
    it (one forward of the whole prompt with its images), in prompt order."""
    model = _model(Path(path))
    inputs = _inputs(_processor(Path(path)), text, images)
    model.model.rope_deltas = None
    logits = model(**inputs).logits[0, :-1].float()
    ids = inputs["input_ids"][0, 1:]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0].tolist()


@torch.no_grad()
def hf_greedy(
    path: Path, text: str, images: list[bytes], steps: int, ids: list[int] | None = None
) -> tuple[list[int], list[float]]:
    """Transformers' greedy answer of ``steps`` tokens to ``text`` with ``images`` (the model
    at ``path``, float32): the tokens (argmax of the raw logits; an end of text does not stop
    it) and each one's log-probability (``log_softmax``). A cached decode loop: the prompt's
    pass sets the model's mrope ``rope_deltas``; the token at index ``i`` past it has the
    position ``i + delta`` on all three axes. ``ids``: the prompt as these ids instead (its
    images' pads expanded), ``text`` unread."""
    model = _model(Path(path))
    if ids is not None:
        text = IMAGE_TOKEN * len(images)
    inputs = _inputs(_processor(Path(path)), text, images)
    if ids is not None:
        given = torch.tensor([ids])  # and what is per token, made of them (1: an image's)
        inputs["input_ids"] = given
        inputs["attention_mask"] = torch.ones_like(given)
        inputs["mm_token_type_ids"] = (given == IMAGE_PAD_ID).long()
    model.model.rope_deltas = None  # left from an earlier prompt, it would shift text-only ones
    out = model(**inputs, use_cache=True, logits_to_keep=1)
    deltas = model.model.rope_deltas  # an image prompt's: position = index + delta
    delta = 0 if deltas is None else int(deltas.reshape(-1)[0])
    length = inputs["input_ids"].shape[1]
    tokens: list[int] = []
    logprobs: list[float] = []
    for step in range(steps):
        logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(logp.argmax())
        tokens.append(token)
        logprobs.append(float(logp[token]))
        if step == steps - 1:
            break
        position = torch.full((3, 1, 1), length + step + delta)  # the same on t, h and w
        out = model(
            input_ids=torch.tensor([[token]]), position_ids=position, cache=out.cache,
            use_cache=True, logits_to_keep=1,
        )  # fmt: skip
    return tokens, logprobs
