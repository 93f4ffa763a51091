"""Prompt sources: JSON lines, Parquet, ``datasets`` folders (with and without ``datasets``),
chat prompts, the held-out split, bad rows counted and logged, errors that say what is wrong."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import structlog.testing

from stages.feeder.arithmetic import (
    ArithmeticConfig,
    ChainConfig,
    Problem,
    chain_problems,
    is_held_out,
    make_chain_tokenizer,
    make_tokenizer,
    problem_rows,
    problems,
)
from stages.feeder.sources import (
    LazyPrompts,
    PromptSet,
    SourceConfig,
    SourceError,
    load_prompts,
)

LONGTAIL_MODEL = Path(__file__).resolve().parents[2] / "configs" / "models" / "longtail-tiny"

# user messages only, then "=" as the generation prompt; a "tool" message makes it raise
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
    "{% elif m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def chat_tok_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("chat_tok")
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def log() -> structlog.testing.CapturingLogger:
    return structlog.testing.CapturingLogger()


def events(log: structlog.testing.CapturingLogger, name: str) -> list[dict]:
    return [call.kwargs for call in log.calls if call.args and call.args[0] == name]


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, (str, bytes)) else json.dumps(r) for r in rows]
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


def ids_of(text: str) -> list[int]:
    return make_tokenizer()(text)["input_ids"]


def ids(ps: PromptSet) -> list[str]:
    return [p["prompt_id"] for p in ps.prompts]


# ------------------------------------------------------------------------------------ jsonl
def test_jsonl_rows_become_prompt_messages(tmp_path, tok_dir, log):
    path = write_jsonl(
        tmp_path / "sums.jsonl",
        [
            {"prompt": "1+2=", "answer": 3, "level": 1, "tags": ["a"]},
            {"prompt": "10-4=", "answer": "6", "level": 2},
        ],
    )
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir, meta_fields=["level"])
    ps = load_prompts(config, "train", log=log)
    assert ps.bad == {}
    assert ps.prompts == [
        {
            "prompt_id": "sums.jsonl:1",
            "input_ids": ids_of("1+2="),
            "meta": {"task": "sums", "text": "1+2=", "level": 1, "answer": "3"},
        },
        {
            "prompt_id": "sums.jsonl:2",
            "input_ids": ids_of("10-4="),
            "meta": {"task": "sums", "text": "10-4=", "level": 2, "answer": "6"},
        },
    ]
    assert all(type(i) is int for p in ps.prompts for i in p["input_ids"])
    (loaded,) = events(log, "prompts_loaded")
    assert loaded["split"] == "train" and loaded["prompts"] == 2 and loaded["bad"] == {}


def test_jsonl_bad_rows_are_counted_and_logged_with_line_numbers(tmp_path, tok_dir, log):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "1+1=", "answer": 2},  # 1 good
            "{not json",  # 2
            "[1, 2]",  # 3
            {"question": "1+1=", "answer": 2},  # 4 no prompt field
            {"prompt": 12, "answer": 2},  # 5 not a string
            {"prompt": "  ", "answer": 2},  # 6 empty
            {"prompt": "2+2="},  # 7 no answer
            {"prompt": "3+3=", "answer": None},  # 8 null answer
            {"prompt": "1" * 40, "answer": 1},  # 9 too long
            "",  # 10 blank line: not a row at all
            b'{"prompt": "\xff"}',  # 11 not UTF-8
            {"prompt": [{"role": "user"}], "answer": 1},  # 12 a message without content
            {"prompt": "4+4=", "answer": 8},  # 13 good
        ],
    )
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir, max_prompt_tokens=30)
    ps = load_prompts(config, "train", log=log)
    assert ids(ps) == ["mixed.jsonl:1", "mixed.jsonl:13"]
    expected = {
        2: "invalid_json",
        3: "not_an_object",
        4: "missing_prompt",
        5: "bad_prompt",
        6: "empty_prompt",
        7: "missing_answer",
        8: "missing_answer",
        9: "too_long",
        11: "invalid_json",
        12: "bad_prompt",
    }
    warned = events(log, "bad_row")
    assert {e["row"]: e["reason"] for e in warned} == expected
    assert all(e["file"] == str(path) for e in warned)
    assert "40 tokens > 30" in next(e["detail"] for e in warned if e["row"] == 9)
    counts = {r: list(expected.values()).count(r) for r in set(expected.values())}
    assert ps.bad == counts
    (loaded,) = events(log, "prompts_loaded")
    assert loaded["bad"] == counts and loaded["prompts"] == 2


def test_a_flood_of_bad_rows_is_counted_not_logged_row_by_row(tmp_path, tok_dir, log):
    path = write_jsonl(tmp_path / "flood.jsonl", ["oops"] * 500 + [{"prompt": "1=", "answer": 1}])
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir)
    ps = load_prompts(config, "train", log=log)
    assert len(ps) == 1 and ps.bad == {"invalid_json": 500}
    assert [e["row"] for e in events(log, "bad_row")] == list(range(1, 21))
    assert len(events(log, "bad_rows_quiet")) == 1
    assert events(log, "prompts_loaded")[0]["bad"] == {"invalid_json": 500}


def test_answer_is_optional_when_not_required(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "open.jsonl", [{"prompt": "1+1="}, {"prompt": "2=", "answer": 0}])
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir, require_answer=False)
    ps = load_prompts(config, "train")
    assert [p["meta"].get("answer") for p in ps.prompts] == [None, "0"]
    assert "answer" not in ps.prompts[0]["meta"]


def test_max_prompt_tokens_drops_longer_prompts(tmp_path, tok_dir):
    rows = [{"prompt": "1" * n, "answer": n} for n in (3, 4, 5, 6)]
    path = write_jsonl(tmp_path / "len.jsonl", rows)
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir, max_prompt_tokens=4)
    ps = load_prompts(config, "train")
    assert [len(p["input_ids"]) for p in ps.prompts] == [3, 4]
    assert ps.bad == {"too_long": 2}


# ------------------------------------------------------------------------------------ errors
def test_missing_file_and_folder_are_clear_errors(tmp_path, tok_dir):
    for kind in ("jsonl", "parquet", "hf_disk"):
        missing = tmp_path / f"nope.{kind}"
        with pytest.raises(SourceError, match=rf"{kind} source .*nope\.{kind}: not found"):
            load_prompts(SourceConfig(kind=kind, path=str(missing), tokenizer=tok_dir), "train")
    with pytest.raises(SourceError, match="looked in"):  # a relative path says where it looked
        load_prompts(SourceConfig(kind="jsonl", path="no/such.jsonl", tokenizer=tok_dir), "train")


def test_a_field_no_row_has_is_a_clear_error(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1=", "answer": 1}] * 3)
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir)
    with pytest.raises(SourceError, match=r"q\.jsonl: no row has the field 'prompt'.*question"):
        load_prompts(config, "train")
    config = SourceConfig(
        kind="jsonl",
        path=str(path),
        tokenizer=tok_dir,
        prompt_field="question",
        meta_fields=["lvl"],
    )
    with pytest.raises(SourceError, match=r"no row has the field 'lvl' \(`meta_fields`\)"):
        load_prompts(config, "train")


def test_no_usable_row_is_a_clear_error(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "bad.jsonl", ["x", {"prompt": "", "answer": 1}])
    with pytest.raises(SourceError, match=r"bad\.jsonl: no usable prompts.*1 empty_prompt"):
        load_prompts(SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir), "train")


def test_tokenizer_and_config_errors(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "1=", "answer": 1}])
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=str(tmp_path / "no_model"))
    with pytest.raises(SourceError, match=r"tokenizer: no folder .*no_model"):
        load_prompts(config, "train")
    with pytest.raises(SourceError, match="no eval split: set `eval_fraction`"):
        load_prompts(SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir), "eval")
    with pytest.raises(ValueError, match="needs `path`"):
        SourceConfig(kind="jsonl", tokenizer=tok_dir)
    with pytest.raises(ValueError, match="needs `tokenizer`"):
        SourceConfig(kind="parquet", path="x.parquet")
    with pytest.raises(ValueError, match="not both"):
        SourceConfig(kind="jsonl", path="a", tokenizer="t", eval_fraction=0.1, eval_path="b")
    with pytest.raises(ValueError, match=r"arithmetic\.eval_fraction"):
        SourceConfig(eval_fraction=0.2)


# ---------------------------------------------------------------------------------- parquet
def write_parquet(path: Path, columns: dict, **kwargs) -> Path:
    pq.write_table(pa.table(columns), path, **kwargs)
    return path


def test_parquet_rows_and_bad_rows(tmp_path, tok_dir, log):
    path = write_parquet(
        tmp_path / "t.parquet",
        {
            "prompt": ["1+1=", None, "2+2=", ""],
            "answer": [2, 3, None, 5],
            "src": ["x", "y", "z", "w"],
            "unused": [0, 0, 0, 0],
        },
        row_group_size=2,
    )
    config = SourceConfig(kind="parquet", path=str(path), tokenizer=tok_dir, meta_fields=["src"])
    ps = load_prompts(config, "train", log=log)
    assert ps.prompts == [
        {
            "prompt_id": "t.parquet:1",
            "input_ids": ids_of("1+1="),
            "meta": {"task": "t", "text": "1+1=", "src": "x", "answer": "2"},
        }
    ]
    assert ps.bad == {"missing_prompt": 1, "missing_answer": 1, "empty_prompt": 1}
    assert {e["row"]: e["reason"] for e in events(log, "bad_row")} == {
        2: "missing_prompt",
        3: "missing_answer",
        4: "empty_prompt",
    }


def test_parquet_unknown_column_and_unreadable_file(tmp_path, tok_dir):
    path = write_parquet(tmp_path / "t.parquet", {"prompts": ["1="], "answer": ["1"]})
    config = SourceConfig(kind="parquet", path=str(path), tokenizer=tok_dir)
    with pytest.raises(
        SourceError, match=r"t\.parquet: no column 'prompt'.*did you mean 'prompts'"
    ):
        load_prompts(config, "train")
    junk = tmp_path / "junk.parquet"
    junk.write_text("this is not parquet")
    config = SourceConfig(kind="parquet", path=str(junk), tokenizer=tok_dir)
    with pytest.raises(SourceError, match=r"junk\.parquet: not a readable Parquet file"):
        load_prompts(config, "train")


def test_parquet_row_group_that_fails_to_decode_makes_bad_rows(tmp_path, tok_dir, log):
    n = 40
    path = write_parquet(
        tmp_path / "c.parquet",
        {"prompt": [f"{i}+{i}=" for i in range(n)], "answer": [str(2 * i) for i in range(n)]},
        row_group_size=n // 2,
    )
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + column.total_compressed_size] = b"\xab" * column.total_compressed_size
    path.write_bytes(bytes(data))
    config = SourceConfig(kind="parquet", path=str(path), tokenizer=tok_dir)
    ps = load_prompts(config, "train", log=log)
    assert ids(ps) == [f"c.parquet:{i}" for i in range(n // 2 + 1, n + 1)]
    assert ps.bad == {"unreadable": n // 2}
    assert events(log, "bad_row")[0]["row"] == 1
    assert "row group 0" in events(log, "bad_row")[0]["detail"]


# ----------------------------------------------------------------------------- hf_disk folders
ROWS = [{"prompt": f"{i}*2=", "answer": 2 * i, "lvl": i % 3} for i in range(12)]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("hf")
    train = datasets.Dataset.from_list(ROWS)
    test = datasets.Dataset.from_list([{"prompt": "9-9=", "answer": 0, "lvl": 0}])
    train.save_to_disk(str(root / "single"))
    datasets.DatasetDict(train=train, test=test).save_to_disk(str(root / "dict"))
    datasets.DatasetDict(validation=test, extra=test).save_to_disk(str(root / "no_train"))
    # several shards: row numbers run on across them
    train.save_to_disk(str(root / "sharded"), num_shards=3)
    return {p.name: p for p in root.iterdir()}


@pytest.fixture(params=["datasets", "pyarrow"])
def reader(request, monkeypatch) -> str:
    if request.param == "pyarrow":
        monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    return request.param


def test_hf_dataset_folder(hf_folders, tok_dir, reader):
    for name in ("single", "sharded"):
        folder = hf_folders[name]
        config = SourceConfig(
            kind="hf_disk", path=str(folder), tokenizer=tok_dir, meta_fields=["lvl"]
        )
        ps = load_prompts(config, "train")
        assert ids(ps) == [f"{name}:{i}" for i in range(1, 13)]
        assert [p["meta"]["answer"] for p in ps.prompts] == [str(r["answer"]) for r in ROWS]
        assert [p["meta"]["lvl"] for p in ps.prompts] == [r["lvl"] for r in ROWS]
        assert ps.prompts[5]["input_ids"] == ids_of("5*2=")
        assert ps.prompts[5]["meta"]["task"] == name


def test_hf_dataset_dict_folder_serves_both_splits(hf_folders, tok_dir, reader):
    config = SourceConfig(kind="hf_disk", path=str(hf_folders["dict"]), tokenizer=tok_dir)
    train, held = load_prompts(config, "train"), load_prompts(config, "eval")
    assert ids(train) == [f"dict/train:{i}" for i in range(1, 13)]
    assert ids(held) == ["dict/test:1"] and held.prompts[0]["meta"]["text"] == "9-9="
    # a DatasetDict without a train subset is an error that lists what is there
    config = SourceConfig(kind="hf_disk", path=str(hf_folders["no_train"]), tokenizer=tok_dir)
    with pytest.raises(SourceError, match="subsets validation, extra; the train split reads"):
        load_prompts(config, "train")
    assert ids(load_prompts(config, "eval")) == ["no_train/validation:1"]


def test_hf_unknown_column_and_not_a_dataset_folder(hf_folders, tmp_path, tok_dir, reader):
    config = SourceConfig(
        kind="hf_disk", path=str(hf_folders["single"]), tokenizer=tok_dir, meta_fields=["level"]
    )
    with pytest.raises(SourceError, match=r"single: no column 'level'.*did you mean 'lvl'"):
        load_prompts(config, "train")
    (tmp_path / "empty").mkdir()
    config = SourceConfig(kind="hf_disk", path=str(tmp_path / "empty"), tokenizer=tok_dir)
    with pytest.raises(SourceError, match="not a datasets save_to_disk folder"):
        load_prompts(config, "train")


# ------------------------------------------------------------------------------------- chat
def test_chat_message_prompts_use_the_chat_template(tmp_path, chat_tok_dir, tok_dir, log):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "prompt": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "1+2"},
                ],
                "answer": 3,
            },
            {"prompt": "4+4", "answer": 8},  # plain text: left alone without chat_template
            {"prompt": [{"role": "tool", "content": "x"}], "answer": 0},  # template raises
        ],
    )
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=chat_tok_dir)
    ps = load_prompts(config, "train", log=log)
    assert [p["meta"]["text"] for p in ps.prompts] == ["1+2=", "4+4"]
    assert [p["input_ids"] for p in ps.prompts] == [ids_of("1+2="), ids_of("4+4")]
    assert ps.bad == {"chat_template": 1}
    assert "no tools" in events(log, "bad_row")[0]["detail"]
    # chat_template: true wraps text prompts as a user message
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=chat_tok_dir, chat_template=True)
    assert [p["meta"]["text"] for p in load_prompts(config, "train").prompts] == ["1+2=", "4+4="]
    # messages, but a tokenizer without a chat template: say so
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir)
    with pytest.raises(SourceError, match=r"chat\.jsonl row 1: .* has no chat template"):
        load_prompts(config, "train")


def test_a_lazy_builtin_task_renders_each_prompt_when_read_as_the_eager_path_does(
    chat_tok_dir, log
):
    arith = ArithmeticConfig(ops="+-", max_operand=30, eval_fraction=0.2)
    config = SourceConfig(arithmetic=arith, tokenizer=chat_tok_dir, chat_template=True)
    eager = load_prompts(config, "train")
    lazy = load_prompts(config, "train", lazy=True)
    assert isinstance(lazy.prompts, LazyPrompts) and len(lazy) == len(eager) > 100
    assert [lazy.prompts[i] for i in range(len(lazy))] == eager.prompts
    plain = SourceConfig(arithmetic=arith, tokenizer=chat_tok_dir)  # no template: tokenized only
    lazy_plain, eager_plain = load_prompts(plain, "train", lazy=True), load_prompts(plain, "train")
    assert [lazy_plain.prompts[i] for i in range(len(lazy_plain))] == eager_plain.prompts
    assert eager.prompts[0]["meta"]["messages"][0]["role"] == "user"
    # a prompt the limit refuses is None when read, counted and logged as the eager path does
    longest = max(len(p["input_ids"]) for p in eager.prompts)
    short = SourceConfig(
        arithmetic=arith, tokenizer=chat_tok_dir, chat_template=True, max_prompt_tokens=longest - 1
    )
    lazy = load_prompts(short, "train", lazy=True, log=log)
    got = [lazy.prompts[i] for i in range(len(lazy))]
    kept = [p for p in eager.prompts if len(p["input_ids"]) < longest]
    assert [p for p in got if p is not None] == kept
    assert (
        lazy.prompts.bad == {"too_long": len(eager) - len(kept)} == load_prompts(short, "train").bad
    )
    assert events(log, "bad_row")[0]["reason"] == "too_long"
    # nothing usable among the first prompts: a source error at load, as the eager path's
    useless = SourceConfig(
        arithmetic=arith, tokenizer=chat_tok_dir, chat_template=True, max_prompt_tokens=1
    )
    with pytest.raises(SourceError, match="none of the first 8 prompts is usable"):
        load_prompts(useless, "train", lazy=True)


# --------------------------------------------------------------------------------- eval split
def test_eval_fraction_holds_out_a_stable_disjoint_share(tmp_path, tok_dir):
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(20) for b in range(20)]
    path = write_jsonl(tmp_path / "all.jsonl", rows)
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir, eval_fraction=0.25)
    train, held = load_prompts(config, "train"), load_prompts(config, "eval")
    assert not set(ids(train)) & set(ids(held))
    assert len(train) + len(held) == len(rows)
    assert 0.15 < len(held) / len(rows) < 0.35
    assert load_prompts(config, "eval").prompts == held.prompts  # stable across calls
    config.split_seed = 1
    assert set(ids(load_prompts(config, "eval"))) != set(ids(held))
    # a separate eval file: train is all of `path`, eval all of `eval_path`
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "7*7=", "answer": 49}])
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir, eval_path=str(other))
    assert len(load_prompts(config, "train")) == len(rows)
    assert ids(load_prompts(config, "eval")) == ["other.jsonl:1"]


def test_duplicate_prompts_never_straddle_the_split(tmp_path, tok_dir):
    rows = [{"prompt": f"{i % 50}=", "answer": i} for i in range(200)]  # each prompt 4 times
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    config = SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir, eval_fraction=0.3)
    train = {p["meta"]["text"] for p in load_prompts(config, "train").prompts}
    held = {p["meta"]["text"] for p in load_prompts(config, "eval").prompts}
    assert train and held and not train & held


# ------------------------------------------------------------------------------- arithmetic
def test_arithmetic_splits_are_exact_and_disjoint(log):
    arith = ArithmeticConfig(ops="+-", max_operand=30, eval_fraction=0.2)
    config = SourceConfig(arithmetic=arith)
    train, held = load_prompts(config, "train", log=log), load_prompts(config, "eval")
    every = [*problems(ArithmeticConfig(ops="+-", max_operand=30, eval_fraction=0.0), "train")]
    assert len(train) + len(held) == len(every)
    assert not set(ids(train)) & set(ids(held))
    assert set(ids(train)) | set(ids(held)) == {p.prompt_id for p in every}
    assert 0.15 < len(held) / len(every) < 0.25
    first = held.prompts[0]
    problem = next(iter(problems(arith, "eval")))
    assert first == {
        "prompt_id": problem.prompt_id,
        "input_ids": ids_of(problem.text),
        "meta": {"task": "arithmetic", "text": problem.text, "answer": problem.answer},
    }
    assert events(log, "prompts_loaded")[0]["prompts"] == len(train)


def test_arithmetic_rows_are_the_problems_split_by_their_hash():
    config = ArithmeticConfig(ops="+-*", max_operand=25, eval_fraction=0.3, split_seed=7)
    for split in ("train", "eval"):
        rows = [*problem_rows(config, split)]
        assert rows == [(p.text, p.answer, p.prompt_id) for p in problems(config, split)]
        assert all(is_held_out(text, config) == (split == "eval") for text, _, _ in rows)
    every = ArithmeticConfig(ops="+-*", max_operand=25, eval_fraction=0.0)
    texts = [text for text, _, _ in problem_rows(every, "train")]
    held = [t for t in texts if is_held_out(t, config)]  # the same hash, one problem at a time
    assert (
        held == [text for text, _, _ in problem_rows(config, "eval")]
        and 0.2 < len(held) / len(texts) < 0.4
    )


def test_arithmetic_min_operand_bounds_both_operands():
    every = [*problems(ArithmeticConfig(ops="*-", max_operand=12, eval_fraction=0.0), "train")]
    config = ArithmeticConfig(ops="*-", min_operand=7, max_operand=12, eval_fraction=0.0)
    some = [*problems(config, "train")]
    # the same problems in the same order as the full range, less those with an operand below 7
    kept = [p for p in every if min(map(int, re.findall(r"\d+", p.text))) >= 7]
    assert some == kept and len(some) == 36 + 21  # 6 x 6 products, 6 * 7 / 2 differences
    assert some[0] == Problem("7*7=", "49") and Problem("12*9=", "108") in some
    calc = ArithmeticConfig(ops="*", min_operand=100, max_operand=999)  # the calculator task
    held = [*problems(calc, "eval")]
    assert 0.09 < len(held) / (900 * 900) < 0.11
    assert all(int(p.answer) == int(p.text[:3]) * int(p.text[4:7]) for p in held)
    assert {len(p.text) for p in held} == {8} and held[0].prompt_id == f"arith:{held[0].text}"
    served = load_prompts(SourceConfig(arithmetic=config), "train")
    assert [p["meta"]["text"] for p in served.prompts] == [p.text for p in some]
    assert [*problems(ArithmeticConfig(min_operand=5, max_operand=5, eval_fraction=0.0), "train")]
    with pytest.raises(ValueError, match=r"min_operand <= max_operand \(got 10\.\.9\)"):
        ArithmeticConfig(min_operand=10, max_operand=9)
    with pytest.raises(ValueError, match="0 <= min_operand"):
        ArithmeticConfig(min_operand=-1)


def test_arithmetic_with_a_tokenizer_from_a_model_folder(tok_dir):
    config = SourceConfig(tokenizer=tok_dir, arithmetic=ArithmeticConfig(max_operand=5))
    ps = load_prompts(config, "train")
    assert all(p["input_ids"] == ids_of(p["meta"]["text"]) for p in ps.prompts)


# ------------------------------------------------------------------------- chain (long tail)
def test_chain_task_is_served_with_a_disjoint_held_out_split(log):
    chain = ChainConfig(size=1500, eval_fraction=0.2)
    config = SourceConfig(kind="chain", chain=chain)
    train, held = load_prompts(config, "train", log=log), load_prompts(config, "eval")
    assert len(train) + len(held) == 1500
    assert not set(ids(train)) & set(ids(held))
    assert 0.15 < len(held) / 1500 < 0.25
    texts = {p["meta"]["text"] for p in train.prompts}
    assert not texts & {p["meta"]["text"] for p in held.prompts}
    first = held.prompts[0]
    problem = next(iter(chain_problems(chain, "eval")))
    assert first == {
        "prompt_id": problem.prompt_id,
        "input_ids": make_chain_tokenizer()(problem.text)["input_ids"],
        "meta": {"task": "chain", "text": problem.text, "answer": problem.answer},
    }
    assert events(log, "prompts_loaded")[0]["source"] == "chain"


def test_chain_with_the_shipped_tokenizer_gives_the_same_ids():
    config = SourceConfig(kind="chain", tokenizer=str(LONGTAIL_MODEL), chain=ChainConfig(size=200))
    ps = load_prompts(config, "train")
    tok = make_chain_tokenizer()
    assert all(p["input_ids"] == tok(p["meta"]["text"])["input_ids"] for p in ps.prompts)


def test_chain_reads_no_files():
    with pytest.raises(ValueError, match=r"chain\.eval_fraction"):
        SourceConfig(kind="chain", eval_fraction=0.1)


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_ids_are_what_the_tokenizer_itself_gives(tmp_path, padding, chat):
    """Prompts are encoded through the fast tokenizer's backend when it has no padding or
    truncation set: ids, special tokens (added to plain text, not to chat-rendered text) and
    the fallback for a tokenizer that pads must all match calling the tokenizer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {
        "<pad>": 0,
        "<eos>": 1,
        "<bos>": 2,
        **{c: i + 3 for i, c in enumerate("0123456789+-=")},
    }
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    if padding:
        core.enable_padding(pad_id=0, pad_token="<pad>", length=16)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    rows = [{"prompt": p, "answer": "0"} for p in ("1+2", "12-3", "7")]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    config = SourceConfig(
        kind="jsonl", path=str(path), tokenizer=str(tmp_path / "tok"), chat_template=chat
    )
    got = [p["input_ids"] for p in load_prompts(config, "train").prompts]
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    if chat:
        texts = [r["prompt"] + "=" for r in rows]
        want = [loaded(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        want = [loaded(r["prompt"])["input_ids"] for r in rows]
    assert got == want
    assert all((ids[0] == 2) != chat for ids in got)  # <bos> on plain text only
    assert not any(0 in ids for ids in got)  # not padded: the backend's padding is off


def test_a_builtin_task_loads_as_its_rows_would(tmp_path, tok_dir, log):
    """The built-in tasks skip the row checks; what they load must be what the same problems
    give as rows of a file, and ``max_prompt_tokens`` still drops (and counts) long ones."""
    task = ArithmeticConfig(ops="+*", max_operand=19, eval_fraction=0.2)
    config = SourceConfig(kind="arithmetic", arithmetic=task, max_prompt_tokens=5)
    loaded = load_prompts(config, "train", log=log)
    rows = [{"prompt": p.text, "answer": p.answer} for p in problems(task, "train")]
    path = write_jsonl(tmp_path / "same.jsonl", rows)
    as_rows = load_prompts(
        SourceConfig(kind="jsonl", path=str(path), tokenizer=tok_dir, max_prompt_tokens=5), "train"
    )
    short = [r for r in rows if len(r["prompt"]) <= 5]
    assert 0 < len(short) < len(rows)
    assert loaded.bad == as_rows.bad == {"too_long": len(rows) - len(short)}
    assert [p["input_ids"] for p in loaded.prompts] == [p["input_ids"] for p in as_rows.prompts]
    assert [p["meta"] for p in loaded.prompts] == [
        {"task": "arithmetic", "text": r["prompt"], "answer": r["answer"]} for r in short
    ]
    assert [p["prompt_id"] for p in loaded.prompts] == [f"arith:{r['prompt']}" for r in short]
    assert events(log, "bad_row")[0]["reason"] == "too_long"
