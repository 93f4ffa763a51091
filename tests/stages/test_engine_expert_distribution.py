"""SGLang 0.5.23's expert-distribution recorder on the built-in engine, through real engine
server processes on a tiny Qwen3-MoE (3 layers of 8 experts, 2 a token, layer 1 dense): the
counts held to the ``top_k_index`` a transformers forward gives its experts modules over the
same tokens, the routes' answers, the dump's file and contents, and the refusals.

SGLang's source (``/tmp/sgl/x/sglang/srt/``): ``entrypoints/http_server.py`` 1267-1294 (the
three routes and their texts), ``eplb/expert_distribution.py`` (``start_record``,
``stop_record``, ``dump_record``; ``_SelectExpertsSinglePassGatherer``,
``_DetailSinglePassGatherer``, ``_StatAccumulator``, ``_DetailAccumulator``, ``_CircularBuffer``,
``_dump_to_file``), ``environ.py`` 1337 (``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``, ``/tmp``),
``arg_groups/fields/exec_.py`` 935-942 and ``arg_groups/parallel_hook.py`` 794-817 (the flags;
the buffer size resolved to 1000), ``managers/scheduler.py`` 6127-6137
(``expert_distribution_handle``).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from tests.stages.engine_setup import (
    ROOT,
    builtin_engine,
    engine_command,
    experts_routing,
    load_reference,
)
from tests.stages.tiny_model import make_tiny_model, make_tiny_moe_model

LAYERS, EXPERTS, K, DENSE = 3, 8, 2, 1  # make_tiny_moe_model's
MODE = "--expert-distribution-recorder-mode"
BUFFER = "--expert-distribution-recorder-buffer-size"
DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"
STAT_FILE = re.compile(r"expert_distribution_recorder_(\d+\.\d+)\.pt")
DETAIL_FILE = re.compile(r"expert_distribution_recorder_(\d+\.\d+)_0\.pt")
# prompts of several lengths: one left-padded prefill pass
PROMPTS = [[5, 17, 33, 8, 50, 41, 7], [9, 3], [60, 61, 62, 63, 64]]
NEW = 6
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
ANSWERS = {
    "start": "Start recording the expert distribution.\n",
    "stop": "Stop recording the expert distribution.\n",
    "dump": "Dump expert distribution record.\n",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe_model(tmp_path_factory.mktemp("models") / "moe", seed=5)


@pytest.fixture(scope="module")
def reference(model: Path) -> torch.nn.Module:
    return load_reference(model)


def _engine(model: Path, folder: Path, *flags: str) -> Iterator[tuple[str, Path]]:
    with builtin_engine(model, *flags, env={DIR_ENV: str(folder)}) as url:
        yield url, folder


@pytest.fixture(scope="module")
def stat(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    yield from _engine(model, tmp_path_factory.mktemp("stat") / "dumps", MODE, "stat")


@pytest.fixture(scope="module", params=["fast", "transformers"])  # the forward path
def per_token(
    model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[str, Path]]:
    """An engine in ``per_token`` mode on the engine's own passes (the recorder's passes
    marked around them) or on transformers' (by hooks on the model's forward)."""
    folder = tmp_path_factory.mktemp(f"per_token_{request.param}")
    for url, dumps in _engine(model, folder, MODE, "per_token", "--forward", request.param):
        info = requests.get(f"{url}/server_info", timeout=30).json()
        assert info["forward_path"] == request.param, info["forward_fallback_reason"]
        yield url, dumps


def _call(url: str, action: str, method: str = "POST") -> requests.Response:
    return requests.request(method, f"{url}/{action}_expert_distribution_record", timeout=60)


def _ok(url: str, action: str, method: str = "POST") -> None:
    answer = _call(url, action, method)
    assert (answer.status_code, answer.text) == (200, ANSWERS[action]), answer.text


def _generate(url: str, prompts: list[list[int]], **params: object) -> list[dict]:
    body = {"input_ids": prompts, "sampling_params": {**GREEDY, **params}}
    answer = requests.post(url + "/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _dump(url: str, folder: Path, pattern: re.Pattern[str]) -> tuple[Path, dict]:
    """Dump (by GET), and the one new file it wrote: its path and contents; its name's time
    is the dump's."""
    before = set(folder.glob("*.pt")) if folder.exists() else set()
    began = time.time()
    _ok(url, "dump", "GET")
    new = sorted(set(folder.glob("*.pt")) - before)
    assert len(new) == 1, new
    found = pattern.fullmatch(new[0].name)
    assert found is not None, new[0].name
    assert began <= float(found.group(1)) <= time.time()
    return new[0], torch.load(new[0], weights_only=True)


def _routing(reference: torch.nn.Module, ids: list[int]) -> dict[int, torch.Tensor]:
    """transformers' routing of ``ids`` in one pass: each MoE layer's ``top_k_index``."""
    taken = experts_routing(reference, ids)
    assert sorted(taken) == [i for i in range(LAYERS) if i != DENSE]
    return taken


def _counts(reference: torch.nn.Module, runs: list[tuple[list[int], int, int]]) -> torch.Tensor:
    """``[layers, experts]``: the tokens transformers routes to each expert over positions
    ``[start, end)`` of each sequence of ``runs``, counted alone (no padding, no batch)."""
    out = torch.zeros((LAYERS, EXPERTS), dtype=torch.int32)
    for ids, start, end in runs:
        for layer, index in _routing(reference, ids).items():
            out[layer] += torch.bincount(index[start:end].flatten(), minlength=EXPERTS).int()
    return out


def _computed(answer: dict, prompt: list[int]) -> tuple[list[int], int, int]:
    """The positions a generating request ran: its uncached prompt and every output token
    but the last (never run), as SGLang's passes compute them."""
    sequence = prompt + answer["output_ids"]
    return sequence, answer["meta_info"]["cached_tokens"], len(sequence) - 1


@pytest.mark.timeout(180)
def test_stat_counts_the_tokens_each_pass_routes_to_each_expert(
    stat: tuple[str, Path], reference: torch.nn.Module
) -> None:
    """SGLang's ``stat`` mode (``_SelectExpertsSinglePassGatherer.on_select_experts``, a
    scatter-add of the top-k ids per layer; ``_StatAccumulator.dump``: ``{rank,
    logical_count, average_utilization_rate_over_window}``, ``logical_count`` the whole
    circular buffer ``[1000, layers, experts]`` int32; ``_dump_to_file``: the name's
    ``time.time()``, the folder ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``, made if missing):
    the counts of a batch of prompts of several lengths (one left-padded prefill, whose padding
    counts nothing) and of a later prompt partly taken from the prefix cache (its cached tokens
    not computed again) equal transformers' routing of those tokens; the dense layer counts
    nothing; a generation while stopped counts nothing; one row a pass."""
    url, folder = stat
    assert not folder.exists()  # the dump makes it
    info = requests.get(url + "/server_info", timeout=10).json()
    assert (
        info["expert_distribution_recorder_mode"],
        info["expert_distribution_recorder_buffer_size"],
    ) == ("stat", 1000)  # SGLang's resolution with a mode and no size (parallel_hook.py)
    _ok(url, "start")
    first = _generate(url, PROMPTS)
    again = _generate(url, [PROMPTS[0]])[0]  # its prompt now in the prefix cache
    assert again["meta_info"]["cached_tokens"] > 0
    _ok(url, "stop", "GET")
    _generate(url, [[70, 71, 72]])  # not recorded
    path, dump = _dump(url, folder, STAT_FILE)
    assert path.parent == folder
    assert list(dump) == ["rank", "logical_count", "average_utilization_rate_over_window"]
    assert dump["rank"] == 0 and dump["average_utilization_rate_over_window"] is None
    counts = dump["logical_count"]
    assert counts.dtype == torch.int32 and counts.shape == (1000, LAYERS, EXPERTS)
    runs = [_computed(a, p) for a, p in zip(first, PROMPTS, strict=True)]
    runs.append(_computed(again, PROMPTS[0]))
    want = _counts(reference, runs)
    assert torch.equal(counts.sum(0), want)
    assert not counts[:, DENSE].any()
    # a pass a row, in order: the batch's prefill, its decode steps, then the other request's
    per_pass = (counts.sum((1, 2)) // (K * (LAYERS - 1))).tolist()
    cached = again["meta_info"]["cached_tokens"]
    prefills = sum(map(len, PROMPTS)), len(PROMPTS[0]) - cached
    steps = [prefills[0], *[3] * (NEW - 1), prefills[1], *[1] * (NEW - 1)]
    assert per_pass == [*steps, *[0] * (1000 - len(steps))]


@pytest.mark.timeout(180)
def test_start_clears_stop_keeps_dump_clears(
    stat: tuple[str, Path], reference: torch.nn.Module
) -> None:
    """``start_record`` resets the record (a second start too, SGLang warns), ``stop_record``
    keeps it for a dump, ``dump_record`` resets it after writing; a dump while stopped or
    never started writes what there is (zeros), as SGLang's."""
    url, folder = stat
    _ok(url, "start")
    _generate(url, [[80, 81, 82, 83]])
    _ok(url, "start", "GET")  # again: what was recorded is cleared
    answer = _generate(url, [[90, 91]])[0]
    _ok(url, "stop")
    _ok(url, "stop")  # not recording: SGLang warns and answers as ever
    _, dump = _dump(url, folder, STAT_FILE)
    want = _counts(reference, [_computed(answer, [90, 91])])
    assert torch.equal(dump["logical_count"].sum(0), want)
    _, empty = _dump(url, folder, STAT_FILE)  # the dump cleared it
    assert empty["logical_count"].shape == (1000, LAYERS, EXPERTS)
    assert not empty["logical_count"].any()
    _ok(url, "start")  # a dump while recording goes on recording, from zero
    _generate(url, [[90, 91]])
    _, first = _dump(url, folder, STAT_FILE)
    answer = _generate(url, [[100, 101, 102]])[0]
    _, second = _dump(url, folder, STAT_FILE)
    _ok(url, "stop")
    assert first["logical_count"].any()
    want = _counts(reference, [_computed(answer, [100, 101, 102])])
    assert torch.equal(second["logical_count"].sum(0), want)


@pytest.mark.timeout(180)
def test_per_token_records_every_pass_with_its_tokens_and_their_experts(
    per_token: tuple[str, Path], reference: torch.nn.Module
) -> None:
    """SGLang's ``per_token`` mode (``_DetailSinglePassGatherer``: ``input_ids``,
    ``positions``, ``extend_seq_lens``, ``forward_mode`` (``EXTEND`` 1, ``DECODE`` 2),
    ``topk_ids_of_layer`` ``[layers, tokens, 8]`` -1 where nothing was routed,
    ``misc_objects``, ``global_physical_count``; ``_DetailAccumulator``: each record
    ``{forward_pass_id, rank, gatherer_key: "primary", ...}``, dumped as ``{records,
    last_physical_to_logical_map}`` to ``expert_distribution_recorder_{time}_{rank}.pt``): a
    batch's prefill and decode passes, each token's experts transformers' own."""
    url, folder = per_token
    _ok(url, "start", "GET")
    answers = _generate(url, PROMPTS)
    _ok(url, "stop")
    _, dump = _dump(url, folder, DETAIL_FILE)
    assert list(dump) == ["records", "last_physical_to_logical_map"]
    mapping = dump["last_physical_to_logical_map"]
    assert mapping.dtype == torch.int64
    assert torch.equal(mapping, torch.arange(EXPERTS).repeat(LAYERS, 1))
    records = dump["records"]
    assert len(records) == NEW  # a prefill, then a decode step a token but the last
    sequences = [p + a["output_ids"] for p, a in zip(PROMPTS, answers, strict=True)]
    routing = [_routing(reference, s[:-1]) for s in sequences]
    ids = [r["forward_pass_id"] for r in records]
    assert ids == list(range(ids[0], ids[0] + NEW))
    for step, record in enumerate(records):
        assert list(record) == [
            "forward_pass_id", "rank", "gatherer_key", "input_ids", "positions",
            "extend_seq_lens", "forward_mode", "topk_ids_of_layer", "misc_objects",
            "global_physical_count",
        ]  # fmt: skip
        assert (record["rank"], record["gatherer_key"], record["misc_objects"]) == (
            0,
            "primary",
            [],
        )
        # each row's tokens of this pass: (sequence, positions)
        if step == 0:
            rows = [(s, range(len(p))) for s, p in zip(sequences, PROMPTS, strict=True)]
            assert record["forward_mode"] == 1
            assert record["extend_seq_lens"] == [len(p) for p in PROMPTS]
        else:
            rows = [
                (s, range(len(p) + step - 1, len(p) + step))
                for s, p in zip(sequences, PROMPTS, strict=True)
            ]
            assert record["forward_mode"] == 2 and record["extend_seq_lens"] is None
        assert record["input_ids"] == [s[i] for s, span in rows for i in span]
        assert record["positions"] == [i for _, span in rows for i in span]
        topk = record["topk_ids_of_layer"]
        assert topk.dtype == torch.int32 and topk.shape == (LAYERS, len(record["input_ids"]), 8)
        assert (topk[:, :, K:] == -1).all() and (topk[DENSE] == -1).all()
        for layer in (0, 2):
            want = torch.cat(
                [
                    r[layer][span.start : span.stop]
                    for r, (_, span) in zip(routing, rows, strict=True)
                ]
            )
            assert torch.equal(topk[layer, :, :K], want.int())
        counts = record["global_physical_count"]
        assert counts.dtype == torch.int32 and counts.shape == (LAYERS, EXPERTS)
        for layer in range(LAYERS):
            valid = topk[layer][topk[layer] >= 0].long()
            assert torch.equal(counts[layer], torch.bincount(valid, minlength=EXPERTS).int())


@pytest.mark.timeout(180)
def test_per_pass_and_a_small_buffer(
    model: Path, reference: torch.nn.Module, tmp_path: Path
) -> None:
    """``per_pass`` (``_SelectExpertsSinglePassGatherer.collect`` under ``_DetailAccumulator``:
    each record ``{forward_pass_id, rank, gatherer_key, global_physical_count}``), and ``stat``
    with ``--expert-distribution-recorder-buffer-size 4`` (``_CircularBuffer``: pass ``i`` in
    row ``i mod 4``, the last 4 passes kept); a dump into a folder that cannot be made is a
    400 naming the file, the record kept for the next dump (SGLang's scheduler would die)."""
    prompt = [5, 17, 33, 8, 50, 41, 7]
    blocked = tmp_path / "blocker"
    blocked.write_text("a file where the dump's folder should be")
    with builtin_engine(model, MODE, "per_pass", env={DIR_ENV: str(tmp_path)}) as url:
        _ok(url, "start")
        answer = _generate(url, [prompt])[0]
        _, dump = _dump(url, tmp_path, DETAIL_FILE)
    sequence = prompt + answer["output_ids"]
    routing = _routing(reference, sequence[:-1])
    spans = [(0, len(prompt))] + [(len(prompt) + i, len(prompt) + i + 1) for i in range(NEW - 1)]
    records = dump["records"]
    assert [list(r) for r in records] == [
        ["forward_pass_id", "rank", "gatherer_key", "global_physical_count"]
    ] * NEW
    for record, (a, b) in zip(records, spans, strict=True):
        want = torch.zeros((LAYERS, EXPERTS), dtype=torch.int32)
        for layer, index in routing.items():
            want[layer] = torch.bincount(index[a:b].flatten(), minlength=EXPERTS)
        assert torch.equal(record["global_physical_count"], want)

    env = {DIR_ENV: str(blocked / "dumps")}
    with builtin_engine(model, MODE, "stat", BUFFER, "4", env=env) as url:
        _ok(url, "start")
        answer = _generate(url, [prompt])[0]  # 6 passes: the last 4 are kept
        refused = _call(url, "dump")
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert str(blocked / "dumps" / "expert_distribution_recorder_") in message
        assert DIR_ENV in message and "kept" in message
        blocked.unlink()
        _, dump = _dump(url, blocked / "dumps", STAT_FILE)
    counts = dump["logical_count"]
    assert counts.shape == (4, LAYERS, EXPERTS)
    sequence = prompt + answer["output_ids"]
    routing = _routing(reference, sequence[:-1])
    for pass_index in range(2, NEW):
        a, b = spans[pass_index]
        want = torch.zeros((LAYERS, EXPERTS), dtype=torch.int32)
        for layer, index in routing.items():
            want[layer] = torch.bincount(index[a:b].flatten(), minlength=EXPERTS)
        assert torch.equal(counts[pass_index % 4], want), pass_index


@pytest.mark.timeout(180)
def test_without_the_flag_the_routes_refuse_and_the_engine_goes_on(tmp_path: Path) -> None:
    """SGLang without ``--expert-distribution-recorder-mode`` has its no-op recorder
    (``ExpertDistributionRecorder.init_new``), whose start, stop and dump raise ``Please set
    ServerArgs.expert_distribution_recorder_mode to use ExpertDistributionRecorder.`` in the
    scheduler, which ends that server (``run_scheduler_process``: SIGQUIT); here each route
    answers 400 with those words, by GET and POST, and the engine serves on."""
    dense = make_tiny_model(tmp_path / "dense", seed=1)
    with builtin_engine(dense, env={DIR_ENV: str(tmp_path / "dumps")}) as url:
        info = requests.get(url + "/server_info", timeout=10).json()
        assert info["expert_distribution_recorder_mode"] is None
        assert info["expert_distribution_recorder_buffer_size"] is None
        for action in ANSWERS:
            for method in ("GET", "POST"):
                answer = _call(url, action, method)
                assert answer.status_code == 400, (action, method)
                message = answer.json()["error"]["message"]
                assert message.startswith(
                    "Please set ServerArgs.expert_distribution_recorder_mode to use "
                    "ExpertDistributionRecorder."
                )
                assert MODE in message
        assert _generate(url, [[5, 6, 7]])[0]["output_ids"]
        assert requests.get(url + "/health", timeout=10).status_code == 200
    assert not (tmp_path / "dumps").exists()


def _refusal(model: Path, *flags: str) -> str:
    """The engine's output when it refuses to start with ``flags`` (its exit code 2)."""
    done = subprocess.run(
        [*engine_command(model, *flags), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout + done.stderr


@pytest.mark.timeout(240)
def test_bad_flags_refuse_to_start(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown mode (SGLang's ``Literal`` choices), ``stat_approx`` (SGLang's
    ``_SinglePassGatherer.init_new`` raises ``NotImplementedError`` without DeepEP's normal
    dispatch), a buffer of 0 passes (SGLang's ``_CircularBuffer`` fails at its first pass)
    and a model without experts (SGLang's ``init_new`` asserts ``ExpertLocationMetadata``)
    each stop the engine at start-up, saying which flag and why (the first three as its
    command line is read, the last once the model is: a process of its own)."""
    from stages.engine.server import parse_args

    def refused(*flags: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--model", str(model), *flags])
        assert exit_.value.code == 2
        return capsys.readouterr().err

    said = refused(MODE, "bogus")
    assert MODE in said and "'bogus': not one of SGLang's modes stat, per_pass, per_token" in said
    said = refused(MODE, "stat_approx")
    assert MODE in said and "DeepEP" in said and "use stat" in said
    said = refused(MODE, "stat", BUFFER, "0")
    assert BUFFER in said and "keeps nothing" in said
    dense = make_tiny_model(tmp_path / "dense", seed=1)
    said = _refusal(dense, MODE, "stat")
    assert "engine_settings_refused" in said and "routes no experts" in said


@pytest.mark.timeout(60)
def test_a_pooling_engine_refuses_the_flag_before_it_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A reward or embedding model is served by the pooling engine, which runs no recorder:
    it says so and exits 2 (the folder is never read)."""
    from stages.engine.pooling_server import serve_pooling
    from stages.engine.server import parse_args

    args = parse_args(["--model", "/nonexistent", MODE, "stat"])
    assert serve_pooling(args, "classify", None) == 2  # type: ignore[arg-type]
    assert MODE in capsys.readouterr().out
