"""Hub repo ids wherever a model or tokenizer folder is accepted (``stages.hub``), offline.

Every test points ``HF_HOME`` at ``tmp_path``, sets ``HF_HUB_OFFLINE=1`` and writes the repos it
needs into a Hub-layout cache by hand (``hub_cache.py``): what is proved is that an id (and
``id@revision``) finds the cached snapshot everywhere a folder is taken (the resolver, a real
``inflight engine`` process, the feeder's and the scorer's tokenizers, the generator's
launcher), that validation pins an id to its commit, and that every way of naming a model wrongly
is a clear error. The download itself is not exercised: no test reaches the Hub.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.feeder.arithmetic import make_tokenizer
from stages.feeder.sources import SourceConfig, SourceError, load_prompts
from stages.hub import HubError, check_model, check_model_folder, resolve_model
from tests.stages.engine_setup import EngineProcess
from tests.stages.hub_cache import offline, save_to_hub_cache
from tests.stages.test_engine_server import Engine
from tests.stages.tiny_model import make_tiny_model
from transport.address import rendezvous_port

ROOT = Path(__file__).resolve().parents[2]
MAIN = "a" * 40  # the commit refs/main points at
OLD = "b" * 40  # an older commit, the branch v1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab=64, seed=3)


@pytest.fixture(scope="module")
def arith_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny: Path, arith_tokenizer: Path) -> Path:
    """An offline Hub cache holding org/tiny (main and v1, two commits) and org/arith-tok (a
    tokenizer only)."""
    cache = offline(monkeypatch, tmp_path / "hf")
    save_to_hub_cache(tiny, cache, "org/tiny", MAIN, refs=["main"])
    old = tmp_path / "old"
    old.mkdir()
    for name in ("config.json", "model.safetensors"):  # v1: a model without a tokenizer
        (old / name).write_bytes((tiny / name).read_bytes())
    save_to_hub_cache(old, cache, "org/tiny", OLD, refs=["v1"])
    save_to_hub_cache(arith_tokenizer, cache, "org/arith-tok", MAIN)
    return cache


def snapshot(cache: Path, repo: str, commit: str) -> Path:
    return cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


# ------------------------------------------------------------------------------- resolving
def test_an_id_finds_the_cached_snapshot_at_each_revision(hub: Path) -> None:
    main = snapshot(hub, "org/tiny", MAIN)
    assert resolve_model("org/tiny", what="model") == main
    assert resolve_model("org/tiny@main", what="model") == main
    assert resolve_model(f"org/tiny@{MAIN}", what="model") == main
    assert resolve_model("org/tiny@v1", what="model") == snapshot(hub, "org/tiny", OLD)
    assert resolve_model(f"org/tiny@{OLD}", what="model") == snapshot(hub, "org/tiny", OLD)
    tok = resolve_model("org/arith-tok", what="tokenizer", needs="tokenizer")
    assert tok == snapshot(hub, "org/arith-tok", MAIN)


def test_the_cache_is_where_the_environment_says_now(
    hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    # huggingface_hub read its variables at import; the resolver reads them when it runs
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.delenv("HF_HUB_CACHE")  # HF_HOME/hub, then
    assert resolve_model("org/tiny", what="model") == snapshot(hub, "org/tiny", MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(HubError, match="not in the cache"):
        resolve_model("org/tiny", what="model")


def test_a_local_folder_is_itself_and_wins_over_an_id(
    hub: Path, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model(str(tiny), what="model") == tiny
    # a folder named like an id, in the working directory, is that folder
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "tiny").symlink_to(tiny)
    assert resolve_model("org/tiny", what="model") == Path("org/tiny")


def test_unknown_ids_revisions_and_paths_are_clear_errors(hub: Path, tmp_path: Path) -> None:
    with pytest.raises(HubError) as info:
        resolve_model("org/nope", what="stages.learner.model")
    text = str(info.value)
    assert text.startswith("stages.learner.model: no folder org/nope")
    assert f"'org/nope': not in the cache {hub}" in text
    assert "HF_HUB_OFFLINE is set" in text and "`hf download org/nope`" in text
    assert "unset HF_HUB_OFFLINE" in text

    with pytest.raises(HubError) as info:
        resolve_model("org/tiny@v9", what="model")
    text = str(info.value)
    assert "has the repo, but not at revision 'v9'" in text
    assert "cached branches and tags: main, v1" in text and MAIN in text
    assert "`hf download org/tiny --revision v9`" in text

    for spec, why in [
        ("configs/models/nope", "a repo id is org/name, with one '/'"),
        ("./nope", "it is written as a path"),
        ("org/tiny@", "nothing after '@'"),
        ("org--x/y", "Cannot have -- or .."),
    ]:
        with pytest.raises(HubError, match="not a Hub repo id either") as info:
            resolve_model(spec, what="model")
        assert why in str(info.value), spec
    assert issubclass(HubError, ValueError)  # config checks report ValueErrors with their key
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(HubError, match="is a file; give the model folder"):
        resolve_model(str(tmp_path / "weights.bin"), what="model")


def test_folders_without_what_is_needed_say_what_is_missing(hub: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("hi")
    with pytest.raises(HubError) as info:
        check_model_folder(empty, needs="model", what="launch.model")
    text = str(info.value)
    assert "launch.model:" in text and "no config.json and no weights" in text
    assert "it holds: notes.txt" in text
    with pytest.raises(HubError, match=r"no tokenizer files \(one of tokenizer.json"):
        check_model_folder(empty, needs="tokenizer")
    with pytest.raises(HubError, match="does not exist"):
        check_model_folder(tmp_path / "gone", needs="model")
    # v1 of org/tiny has weights but no tokenizer: fine as a model, not as a tokenizer
    assert resolve_model("org/tiny@v1", what="model").name == OLD
    with pytest.raises(HubError, match=r"Hub repo 'org/tiny' at revision 'v1'.*no tokenizer"):
        resolve_model("org/tiny@v1", what="tokenizer", needs="tokenizer")


def test_validation_pins_an_id_to_its_commit(hub: Path, tiny: Path) -> None:
    assert check_model("org/tiny") == f"org/tiny@{MAIN}"
    assert check_model("org/tiny@v1") == f"org/tiny@{OLD}"
    assert check_model("org/arith-tok", needs="tokenizer") == f"org/arith-tok@{MAIN}"
    assert check_model(str(tiny), needs="tokenizer") == str(tiny)  # a folder is kept as given
    with pytest.raises(HubError, match="no tokenizer files"):
        check_model("org/tiny@v1", needs="tokenizer")
    with pytest.raises(HubError, match="not in the cache"):
        check_model("org/nope")
    # the loader calls the field's check: the pinned spec resolves the same, with no lookup
    assert resolve_model(check_model("org/tiny"), what="m") == snapshot(hub, "org/tiny", MAIN)


# -------------------------------------------------------------------- the stages that load
def test_feeder_and_scorer_tokenizers_load_by_id(hub: Path) -> None:
    from stages.scorer.stage import _load_tokenizer

    config = SourceConfig(kind="arithmetic", tokenizer="org/arith-tok")
    prompts = load_prompts(config, "eval")
    ids = make_tokenizer()
    first = prompts.prompts[0]
    assert first["input_ids"] == ids(first["meta"]["text"])["input_ids"]
    scorer_tok = _load_tokenizer("org/arith-tok@main")
    assert scorer_tok.decode(first["input_ids"]) == ids.decode(first["input_ids"])
    with pytest.raises(SourceError, match="'org/nope': not in the cache"):
        load_prompts(SourceConfig(kind="arithmetic", tokenizer="org/nope"), "eval")
    with pytest.raises(HubError, match="no tokenizer files"):
        _load_tokenizer("org/tiny@v1")


def test_the_engine_loader_takes_an_id(hub: Path) -> None:
    from stages.engine.loader import load_model

    loaded = load_model("org/tiny")
    assert loaded.path == snapshot(hub, "org/tiny", MAIN)
    assert loaded.tokenizer is not None and loaded.vocab_size == 64
    with pytest.raises(HubError, match="--model: no folder org/nope"):
        load_model("org/nope")


@pytest.mark.timeout(90)
def test_inflight_engine_serves_a_model_named_by_id(hub: Path, tmp_path: Path) -> None:
    log_file = tmp_path / "engine.jsonl"
    flags = ("--max-running", "4", "--log-file", str(log_file))
    proc = EngineProcess("org/tiny@main", *flags, tail=log_file)
    try:
        engine = Engine(proc.wait_up(75), tmp_path, log_file)
        status, info = engine.request("GET", "/model_info")
        assert status == 200 and info["model_path"] == str(snapshot(hub, "org/tiny", MAIN))
        out = engine.generate(
            {"text": "w5 w6", "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
        )
        assert len(out["output_ids"]) == 3 and isinstance(out["text"], str)
    finally:
        assert proc.stop(15) == 0, proc.tail()


@pytest.mark.timeout(30)
def test_the_launcher_resolves_before_starting_any_engine(hub: Path, tmp_path: Path) -> None:
    """SGLang gets the snapshot folder as --model-path; an unknown id starts nothing."""
    from stages.generator.launcher import EngineLauncher, LaunchConfig
    from tests.stages.test_generator_launcher import FAKE_ENGINE, _Log

    fake = tmp_path / "fake_engine.py"
    fake.write_text(FAKE_ENGINE)
    fake.chmod(0o755)

    async def go(model: str, log: _Log) -> None:
        config = LaunchConfig(kind="sglang", python=str(fake), model=model, startup_timeout_s=20)
        launcher = EngineLauncher(config, name="gen.0", log_dir=tmp_path, log=log)
        try:
            await launcher.start()
        finally:
            await launcher.close()

    log = _Log()
    asyncio.run(go("org/tiny@v1", log))
    [launched] = [e for e in log.events if e["event"] == "engine_launched"]
    assert f"--model-path {snapshot(hub, 'org/tiny', OLD)} " in launched["command"]
    [said] = [e for e in log.events if e["event"] == "engine_model"]
    assert said["model"] == "org/tiny@v1"
    assert said["folder"] == str(snapshot(hub, "org/tiny", OLD))

    log = _Log()
    with pytest.raises(HubError, match=r"launch\.model: no folder org/nope"):
        asyncio.run(go("org/nope", log))
    assert not [e for e in log.events if e["event"] == "engine_launched"]


def test_config_fields_that_take_a_model_are_checked_by_validation() -> None:
    """Every field that takes a model or tokenizer carries the check validation runs on it."""
    import dataclasses

    from stages.generator.launcher import LaunchConfig
    from stages.hub import model_check, tokenizer_check
    from stages.learner.config import LearnerConfig
    from stages.scorer.stage import ScorerConfig

    def check_of(cls: type, name: str) -> object:
        return {f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("check")

    assert check_of(LearnerConfig, "model") is model_check
    assert check_of(LearnerConfig, "ref_model") is model_check
    assert check_of(LaunchConfig, "model") is model_check
    assert check_of(ScorerConfig, "tokenizer") is tokenizer_check
    assert check_of(SourceConfig, "tokenizer") is tokenizer_check


# ------------------------------------------------------- online, against a stand-in Hub API
class _HubAPI(http.server.BaseHTTPRequestHandler):
    """What huggingface_hub asks the Hub for a repo's info (``GET /api/models/ID[/revision/R]``)
    and how the Hub says no (404 with ``X-Error-Code``): org/tiny at main, org/weightless (a
    config but no weights); any other repo or revision does not exist."""

    repos = {
        "org/tiny": ["config.json", "model.safetensors", "tokenizer.json"],
        "org/weightless": ["config.json", "README.md"],
    }

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        repo, _, revision = path.removeprefix("/api/models/").partition("/revision/")
        if repo not in self.repos:
            self._no("RepoNotFound")
        elif revision not in ("", "main", MAIN):
            self._no("RevisionNotFound")
        else:
            siblings = [{"rfilename": name} for name in self.repos[repo]]
            body = json.dumps({"id": repo, "sha": MAIN, "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def _no(self, code: str) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Online mode (HF_HUB_OFFLINE unset) against the stand-in API; an empty cache."""
    import huggingface_hub.constants

    cache = offline(monkeypatch, tmp_path / "hf")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubAPI)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield cache
    finally:
        server.shutdown()
        server.server_close()


def test_online_validation_asks_the_hub_and_downloads_nothing(online: Path) -> None:
    assert check_model("org/tiny") == f"org/tiny@{MAIN}"
    assert check_model("org/tiny@main", needs="tokenizer") == f"org/tiny@{MAIN}"
    assert not any(online.iterdir())  # nothing was downloaded
    with pytest.raises(HubError, match=r"Hub repo 'org/tiny' at revision 'v9': the repo has no "):
        check_model("org/tiny@v9")
    with pytest.raises(HubError, match="'org/nope': no such model repo on the Hub"):
        check_model("org/nope")
    with pytest.raises(HubError, match="'org/weightless' is not a usable model: it has no weights"):
        check_model("org/weightless")
    with pytest.raises(HubError, match="is not a usable tokenizer: it has no tokenizer files"):
        check_model("org/weightless", needs="tokenizer")
    # the loaders' resolver asks the same API before downloading: an unknown id stops there
    with pytest.raises(HubError, match=r"learner\.model: no folder org/nope.*no such model repo"):
        resolve_model("org/nope", what="learner.model")
    with pytest.raises(HubError, match="has no revision 'v9'"):
        resolve_model("org/tiny@v9", what="learner.model")


def test_an_unreachable_hub_falls_back_to_the_cache(
    online: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{rendezvous_port()}")  # nobody listens
    save_to_hub_cache(tiny, online, "org/cached", MAIN)
    assert check_model("org/cached") == f"org/cached@{MAIN}"
    assert resolve_model("org/cached", what="m") == snapshot(online, "org/cached", MAIN)
    with pytest.raises(HubError) as info:
        check_model("org/elsewhere")
    assert "not in the cache" in str(info.value)
    assert "the Hub could not be reached: ConnectError" in str(info.value)
