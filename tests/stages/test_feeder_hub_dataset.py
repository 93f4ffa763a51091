"""Prompt sources: ``kind: hf``, a dataset by name through ``datasets``, offline.

The dataset ``org/sums`` (configuration ``main``, splits ``train`` and ``test``) is prepared in
``HF_DATASETS_CACHE`` under ``tmp_path`` exactly where an online ``load_dataset("org/sums",
"main")`` would leave it (``hub_cache.save_dataset_to_cache``), and ``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE`` are set: this proves that the source finds a dataset by name in the cache,
maps its columns as the file kinds do, serves train and eval splits, and that a wrong name,
configuration, split or column is an error naming the key. It cannot prove the download (no test
reaches the Hub). A local folder of data files (``dataset: ./folder``) goes the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.feeder.arithmetic import make_tokenizer
from stages.feeder.sources import SourceConfig, SourceError, load_prompts
from tests.stages.hub_cache import offline, save_dataset_to_cache

COMMIT = "c" * 40
TRAIN = {"question": [f"{a}+{a}=" for a in range(1, 21)], "solution": [2 * a for a in range(1, 21)]}
TEST = {"question": ["30+1=", "40+2="], "solution": [31, 42]}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture
def hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline datasets cache holding org/sums (config main: train, test)."""
    offline(monkeypatch, tmp_path / "hf")
    files = {}
    for split, columns in (("train", TRAIN), ("test", TEST)):
        files[split] = tmp_path / f"{split}.parquet"
        pq.write_table(pa.table(columns), files[split])
    return save_dataset_to_cache(files, tmp_path / "hf" / "datasets", "org/sums", "main", COMMIT)


def source(tok_dir: str, **more) -> SourceConfig:
    options = {
        "kind": "hf",
        "dataset": "org/sums",
        "dataset_config": "main",
        "prompt_field": "question",
        "answer_field": "solution",
        "tokenizer": tok_dir,
    }
    return SourceConfig(**{**options, **more})


def test_a_named_dataset_serves_train_and_eval_splits(hf, tok_dir):
    train = load_prompts(source(tok_dir, eval_split="test"), "train")
    assert len(train) == 20
    first = train.prompts[0]
    assert first["prompt_id"] == "org/sums/main/train:1"
    assert first["meta"] == {"task": "sums", "text": "1+1=", "answer": "2"}
    assert first["input_ids"] == make_tokenizer()("1+1=")["input_ids"]
    held = load_prompts(source(tok_dir, eval_split="test"), "eval")
    assert [p["meta"]["answer"] for p in held.prompts] == ["31", "42"]
    assert held.prompts[1]["prompt_id"] == "org/sums/main/test:2"
    # datasets' split syntax, and a revision written after the id (offline: the cached one)
    part = load_prompts(source(tok_dir, split="train[:5]", dataset="org/sums@main"), "train")
    assert [p["meta"]["text"] for p in part.prompts] == TRAIN["question"][:5]


def test_eval_fraction_holds_out_a_disjoint_share_of_the_split(hf, tok_dir):
    config = source(tok_dir, eval_fraction=0.3, split_seed=1)
    train, held = load_prompts(config, "train"), load_prompts(config, "eval")
    texts = {p["meta"]["text"] for p in train.prompts}
    assert len(train) + len(held) == 20 and len(held) > 0
    assert texts.isdisjoint(p["meta"]["text"] for p in held.prompts)
    with pytest.raises(SourceError, match="no eval split: set `eval_split`"):
        load_prompts(source(tok_dir), "eval")


def test_wrong_name_config_split_and_column_name_the_key(hf, tok_dir):
    with pytest.raises(SourceError) as info:
        load_prompts(source(tok_dir, dataset="org/nope"), "train")
    text = str(info.value)
    assert "hf source 'org/nope'" in text and "not in the datasets cache" in text
    assert "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set" in text and "check `dataset`" in text
    with pytest.raises(SourceError) as info:
        load_prompts(source(tok_dir, dataset_config="other"), "train")
    text = str(info.value)
    assert "dataset_config 'other'" in text and "`dataset_config`" in text and "main" in text
    with pytest.raises(SourceError) as info:
        load_prompts(source(tok_dir, split="bogus"), "train")
    assert "no split 'bogus' (`split`)" in str(info.value)
    assert "its splits: train, test" in str(info.value)
    with pytest.raises(SourceError, match=r"no split 'dev' \(`eval_split`\)"):
        load_prompts(source(tok_dir, eval_split="dev"), "eval")
    with pytest.raises(SourceError) as info:
        load_prompts(source(tok_dir, prompt_field="questoin"), "train")
    assert "no column 'questoin' (from `prompt_field`); did you mean 'question'?" in str(info.value)


def test_a_local_folder_of_data_files_by_name(hf, tok_dir, tmp_path):
    folder = tmp_path / "local_sums"
    folder.mkdir()
    rows = [{"question": "7+7=", "solution": 14}, {"question": "8+8=", "solution": 16}]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = source(tok_dir, dataset=str(folder), dataset_config="")
    got = load_prompts(config, "train")
    assert [p["meta"]["answer"] for p in got.prompts] == ["14", "16"]
    assert got.prompts[0]["prompt_id"] == "local_sums/train:1"
    assert got.prompts[0]["meta"]["task"] == "local_sums"


def test_config_errors_before_anything_loads(tok_dir):
    with pytest.raises(ValueError, match="kind 'hf' needs `dataset`"):
        SourceConfig(kind="hf", tokenizer=tok_dir)
    with pytest.raises(ValueError, match="drop path/eval_path"):
        SourceConfig(kind="hf", dataset="org/sums", path="x.jsonl", tokenizer=tok_dir)
    with pytest.raises(ValueError, match="`eval_split` or `eval_fraction`, not both"):
        source(tok_dir, eval_split="test", eval_fraction=0.1)
    with pytest.raises(ValueError, match="needs `tokenizer`"):
        SourceConfig(kind="hf", dataset="org/sums")
    with pytest.raises(ValueError, match="dataset is for kinds 'hf' and 'reasoning_gym'"):
        SourceConfig(kind="jsonl", path="x.jsonl", tokenizer=tok_dir, dataset="org/sums")
