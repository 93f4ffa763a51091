"""``stages.light_tokenizer``: a folder's tokenizer read with ``tokenizers`` alone gives the ids
and text transformers' gives, and folders it could not read the same way load with transformers.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from stages.hf import AutoTokenizer, PreTrainedTokenizerFast
from stages.light_tokenizer import (
    LightTokenizer,
    light_reason,
    load_tokenizer,
    transformers_tokenizer,
)
from tests.pipeline.runs import REPO, python_lines

MODELS = REPO / "configs" / "models"
SHIPPED = sorted(p.name for p in MODELS.iterdir() if (p / "tokenizer.json").is_file())


def _texts(tokenizer: LightTokenizer, rng: random.Random, n: int = 200) -> list[str]:
    """Random texts from the vocabulary's characters, the special tokens' text, spaces and
    characters no vocabulary here has."""
    chars = sorted({c for token in tokenizer.get_vocab() for c in token})
    pieces = [*chars, " ", "  ", "\n", "é", "漢", "🙂", "<eos>", "<pad>", "<|bos|>", "<|eos|>"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 24))) for _ in range(n)]


def _same(light: LightTokenizer, full, seed: int = 0) -> None:
    rng = random.Random(seed)
    for text in _texts(light, rng):
        for special in (True, False):
            assert light.encode(text, add_special_tokens=special) == full.encode(
                text, add_special_tokens=special
            ), (text, special)
    size = len(full)
    for _ in range(200):
        ids = [rng.randrange(size) for _ in range(rng.randint(0, 12))]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)
    assert light.batch_decode([[1, 2], [3]], True) == full.batch_decode([[1, 2], [3]], True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "vocab_size"):
        assert getattr(light, name) == getattr(full, name), name
    assert len(light) == len(full)
    assert light.get_vocab() == full.get_vocab()
    assert light.convert_ids_to_tokens([0, 1]) == full.convert_ids_to_tokens([0, 1])


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_models_read_light_and_match_transformers(name: str) -> None:
    folder = MODELS / name
    tokenizer = load_tokenizer(folder)
    if light_reason(folder) is not None:  # a model's own class (the teacher's Qwen2Tokenizer)
        assert not isinstance(tokenizer, LightTokenizer)
        return
    assert isinstance(tokenizer, LightTokenizer)
    _same(tokenizer, transformers_tokenizer(folder))  # as the engine reads it


def _bpe_folder(path: Path) -> Path:
    """A byte-level BPE tokenizer with three special tokens and a post-processor that starts
    every text with ``<|bos|>``, saved as transformers saves a generic one."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    words = ["the cat sat on the mat", "a dog and a cat", "12 + 34 = 46", "héllo wörld"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(words * 20, trainer)
    core.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", 1)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    ).save_pretrained(path)
    return path


def test_a_byte_level_bpe_with_a_post_processor_matches_transformers(tmp_path: Path) -> None:
    folder = _bpe_folder(tmp_path / "bpe")
    assert light_reason(folder) is None
    light = load_tokenizer(folder)
    assert isinstance(light, LightTokenizer)
    full = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)  # no model type
    assert light.encode("the cat")[0] == light.bos_token_id == 1  # the post-processor ran
    _same(light, full, seed=1)


def _edit(folder: Path, name: str, change) -> None:
    path = folder / name
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_folder_with_added_tokens_json_loads_with_transformers(tmp_path: Path) -> None:
    folder = _bpe_folder(tmp_path / "bpe")
    (folder / "added_tokens.json").write_text(json.dumps({"<|x|>": 300}))
    assert light_reason(folder) == "added_tokens.json"
    assert not isinstance(load_tokenizer(folder), LightTokenizer)


def test_padding_saved_in_tokenizer_json_loads_with_transformers(tmp_path: Path) -> None:
    folder = _bpe_folder(tmp_path / "bpe")
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    raw.enable_padding(pad_id=0, pad_token="<|pad|>", length=8)
    raw.save(str(folder / "tokenizer.json"))
    assert light_reason(folder) == "padding or truncation in tokenizer.json"
    assert not isinstance(load_tokenizer(folder), LightTokenizer)


@pytest.mark.parametrize(
    ("what", "file", "change"),
    [
        (
            "tokenizer_class 'Qwen2Tokenizer'",
            "tokenizer_config.json",
            lambda d: d.update(tokenizer_class="Qwen2Tokenizer"),
        ),
        ("add_eos_token", "tokenizer_config.json", lambda d: d.update(add_eos_token=True)),
        ("add_bos_token", "tokenizer_config.json", lambda d: d.update(add_bos_token=False)),
        (
            "added_tokens_decoder[2] differs",
            "tokenizer_config.json",
            lambda d: d.update(
                added_tokens_decoder={"2": {"content": "<|eos|>", "special": True, "lstrip": True}}
            ),
        ),
        (
            "split_special_tokens",
            "tokenizer_config.json",
            lambda d: d.update(split_special_tokens=True),
        ),
        (
            "clean_up_tokenization_spaces",
            "tokenizer_config.json",
            lambda d: d.update(clean_up_tokenization_spaces=True),
        ),
        (
            "eos_token is not a special token",
            "tokenizer_config.json",
            lambda d: d.update(eos_token="<|end|>"),
        ),
        (
            "padding or truncation",
            "tokenizer.json",
            lambda d: d.update(
                truncation={
                    "direction": "Right",
                    "max_length": 4,
                    "strategy": "LongestFirst",
                    "stride": 0,
                }
            ),
        ),
    ],
)
def test_folders_transformers_would_read_otherwise_load_with_transformers(
    tmp_path: Path, what: str, file: str, change
) -> None:
    folder = _bpe_folder(tmp_path / "bpe")
    _edit(folder, file, change)
    assert what in (light_reason(folder) or "")
    assert not isinstance(load_tokenizer(folder), LightTokenizer)


def test_the_gate_matters_a_named_token_missing_from_tokenizer_json(tmp_path: Path) -> None:
    """transformers adds a special token the config names and tokenizer.json lacks, so the
    backend alone would split it: the gate sends such a folder to transformers."""
    folder = _bpe_folder(tmp_path / "bpe")
    _edit(folder, "tokenizer_config.json", lambda d: d.update(eos_token="<|end|>"))
    full = load_tokenizer(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert full.encode("a<|end|>") != raw.encode("a<|end|>").ids
    assert full.encode("a<|end|>")[-1] == full.eos_token_id


def test_what_it_does_not_answer_goes_to_transformers(tmp_path: Path) -> None:
    folder = tmp_path / "chat"
    shutil.copytree(MODELS / "calc-chat-tiny", folder)
    light = load_tokenizer(folder)
    assert isinstance(light, LightTokenizer)
    full = transformers_tokenizer(folder)
    messages = [{"role": "user", "content": "12+3="}]
    assert light.chat_template == full.chat_template
    assert light.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == full.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert light(["1+2="])["input_ids"] == full(["1+2="])["input_ids"]
    # arguments it does not take itself: transformers' answer
    assert light.encode("1+2=", "3", add_special_tokens=False) == full.encode(
        "1+2=", "3", add_special_tokens=False
    )
    ids = light.encode("1 + 2 =")
    assert light.decode(ids, clean_up_tokenization_spaces=True) == full.decode(
        ids, clean_up_tokenization_spaces=True
    )


def test_it_pickles_and_copies_as_it_is() -> None:
    import copy
    import pickle

    light = load_tokenizer(MODELS / "arith-tiny")
    for other in (pickle.loads(pickle.dumps(light)), copy.deepcopy(light)):
        assert isinstance(other, LightTokenizer) and other._full is None
        assert other.encode("12+34=") == light.encode("12+34=") == [3, 4, 12, 5, 6, 15]
        assert other.decode([3, 4, 12]) == "12+" and other.eos_token_id == light.eos_token_id
        assert other.pad_token == "<pad>" and other("1+2=")["input_ids"] == [3, 12, 4, 15]


def test_feeder_and_scorer_load_the_default_tokenizer_without_transformers() -> None:
    code = (
        "import sys\n"
        "from stages.feeder.sources import SourceConfig, load_prompts\n"
        "from stages.scorer.stage import _load_tokenizer\n"
        "from stages.detokenize import batch_decoder\n"
        "config = SourceConfig(kind='arithmetic', tokenizer='configs/models/arith-tiny')\n"
        "prompts = load_prompts(config, 'train')\n"
        "tok = _load_tokenizer('configs/models/arith-tiny')\n"
        "first = prompts.prompts[0]\n"
        "print(tok.decode(first['input_ids']) == first['meta']['text'])\n"
        "print(batch_decoder(tok)([[3, 4, 12]], True))\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    lines = python_lines(code)
    assert lines[-3:-1] == ["True", "['12+']"]
    assert lines[-1] == "[]"


async def test_a_multi_turn_rollout_has_its_chat_tokenizer_loaded_at_start() -> None:
    """Episodes render chats with transformers: it is loaded when the rollouts start, not at
    the first episode, when it would stop the event loop for seconds mid-run."""
    import structlog

    from stages.rollouts.api import RolloutConfig
    from stages.rollouts.runtime import RolloutRuntime

    config = RolloutConfig(
        use="environment",
        environment="tests.stages.test_learner_evaluate:Echo",
        tokenizer=str(MODELS / "calc-chat-tiny"),
        max_turns=2,
    )
    runtime = await RolloutRuntime.start(config, log=structlog.get_logger())
    try:
        assert isinstance(runtime.tokenizer, LightTokenizer)
        assert runtime.tokenizer._full is not None
    finally:
        await runtime.aclose()
