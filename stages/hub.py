"""Model and tokenizer folders from a local path or a Hugging Face Hub repo id.

Wherever a model or tokenizer folder is accepted, a Hub repo id works too: ``org/name``, or
``org/name@REVISION`` (a branch, a tag or a commit). ``resolve_model(spec, what=...)`` returns
a local folder: an existing folder is itself; a repo id is the snapshot folder in the Hub cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``), downloaded first unless ``HF_HUB_OFFLINE`` is set, in
which case only the cache is looked at. Only the files that loading needs are downloaded
(configs, tokenizer files and, for a model, the safetensors weights, or the ``.bin`` ones when a
repo has no safetensors): never the ``original/`` checkpoints or ONNX/GGUF exports a repo may
also hold. Every loader then opens the folder with ``local_files_only=True``.

``check_model(spec, needs=...)`` is what validation runs before anything starts: the same
lookup without downloading (online: one Hub API call for the repo's file list; offline: the
cache), a check that the files are there (``check_model_folder``), and the spec pinned to its
commit (``org/name@<sha>``) so that every process of a run loads the same snapshot even if the
branch moves during the run.

Errors are ``HubError`` (a ``ValueError``) saying what was asked (``what``, the config key),
what was tried (the local path checked and the Hub id and revision) and how to fix it. Not here:
loading models or tokenizers (the stages do, from the folder returned), datasets
(``stages.feeder.sources``, ``kind: hf``), logging in (``hf auth login`` or ``HF_TOKEN``).

    python -c "from stages.hub import resolve_model; print(resolve_model('org/name', what='x'))"
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Collection
from pathlib import Path
from typing import Literal

__all__ = [
    "TOKENIZER_FILES",
    "HubError",
    "Needs",
    "check_model",
    "check_model_folder",
    "model_check",
    "resolve_model",
    "tokenizer_check",
]

Needs = Literal["model", "tokenizer"]

_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's truthy environment values
# a folder holds a tokenizer when it has one of these (the engine's loader reads the same list)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
_TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
# the code a model ships (auto_map) comes with it, and runs only where --trust-remote-code says
_MODEL_PATTERNS = [*_TOKENIZER_PATTERNS, "*.safetensors", "*.py"]


class HubError(ValueError):
    """A model or tokenizer that cannot be found or used; the message says what was tried."""


def resolve_model(spec: str, *, what: str, needs: Needs = "model") -> Path:
    """The local folder for ``spec`` (a folder, or a Hub repo id with an optional ``@revision``).

    ``what`` names the config key or option asking (for errors). ``needs``: ``tokenizer`` fetches
    no weights. Raises ``HubError``. Online, a repo not yet cached is downloaded here.
    """
    local, repo_id, revision = _parse(spec, what)
    if local is not None:
        check_model_folder(local, needs=needs, what=what)
        return local
    offline = _offline()
    patterns = _TOKENIZER_PATTERNS if needs == "tokenizer" else _MODEL_PATTERNS
    folder = _snapshot(spec, what, repo_id, revision, local_only=offline, patterns=patterns)
    if needs == "model" and not offline and not _weights_in(folder):
        # a repo with PyTorch .bin weights only: fetch those
        patterns = [*patterns, "pytorch_model*.bin"]
        folder = _snapshot(spec, what, repo_id, revision, local_only=False, patterns=patterns)
    check_model_folder(
        folder, needs=needs, what=f"{_prefix(what)}Hub repo {_at(repo_id, revision)}"
    )
    return folder


def check_model_folder(path: str | Path, *, needs: Needs, what: str = "") -> None:
    """Raise ``HubError`` unless ``path`` is a folder holding a model (``config.json`` and
    weights) or a tokenizer (``tokenizer.json``, ``tokenizer_config.json`` or a vocab file)."""
    folder = Path(path)
    if not folder.is_dir():
        found = "is a file, not a folder" if folder.exists() else "does not exist"
        raise HubError(f"{_prefix(what)}{_shown(folder)} {found}")
    names = [p.name for p in folder.iterdir() if not p.is_dir()]
    missing = _missing(names, needs)
    if missing:
        has = ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "") or "nothing"
        raise HubError(
            f"{_prefix(what)}{_shown(folder)} is not a usable {needs} folder: it has no {missing} "
            f"(it holds: {has})"
        )


def check_model(spec: str, *, needs: Needs = "model", what: str = "") -> str:
    """Validation before a run: ``spec`` names a folder or Hub repo holding a ``needs``; returns
    the spec to run with (a folder as given; a repo id pinned as ``org/name@<commit>``).

    Downloads nothing: online it asks the Hub for the repo's file list at that revision (falling
    back to the cache when the Hub cannot be reached), offline it reads the cache. Raises
    ``HubError``.
    """
    local, repo_id, revision = _parse(spec, what)
    if local is not None:
        check_model_folder(local, needs=needs, what=what)
        return spec
    if not _offline():
        try:
            sha, names = _remote_files(repo_id, revision, what)
        except _Unreachable as exc:
            unreachable: Exception | None = exc.__cause__
        else:
            missing = _missing(names, needs)
            if missing:
                raise HubError(
                    f"{_prefix(what)}Hub repo {_at(repo_id, revision)} is not a usable {needs}: "
                    f"it has no {missing}"
                )
            return f"{repo_id}@{sha}"
    else:
        unreachable = None
    folder = _snapshot(
        spec, what, repo_id, revision, local_only=True, patterns=None, why=unreachable
    )
    check_model_folder(folder, needs=needs, what=what)
    return f"{repo_id}@{folder.name}"


def model_check(value: str) -> str:
    """``check_model`` for a model; a config field's ``check`` metadata (run by validation)."""
    return check_model(value, needs="model")


def tokenizer_check(value: str) -> str:
    """``check_model`` for a tokenizer; a config field's ``check`` metadata."""
    return check_model(value, needs="tokenizer")


# ------------------------------------------------------------------------------ the lookup
def _parse(spec: str, what: str) -> tuple[Path | None, str, str | None]:
    """``(folder, "", None)`` for an existing folder, else ``(None, repo_id, revision)``."""
    if not isinstance(spec, str) or not spec.strip():
        raise HubError(f"{_prefix(what)}empty; give a model folder or a Hub repo id (org/name)")
    path = Path(spec).expanduser()
    if path.is_dir():
        return path, "", None
    if path.exists():
        raise HubError(
            f"{_prefix(what)}{_shown(path)} is a file; give the model folder that holds it"
        )
    repo_id, at, revision = spec.partition("@")
    reason = _not_a_repo_id(spec, repo_id)
    if reason or (at and not revision):
        reason = reason or "nothing after '@' (write org/name@REVISION)"
        raise HubError(
            f"{_prefix(what)}no folder {_shown(path)}, and {spec!r} is not a Hub repo id either "
            f"({reason}); check the path, or give a repo id as org/name or org/name@REVISION"
        )
    return None, repo_id, revision or None


def _not_a_repo_id(spec: str, repo_id: str) -> str:
    if spec.startswith(("/", "./", "../", "~")):
        return "it is written as a path"
    if repo_id.count("/") > 1:
        return "a repo id is org/name, with one '/'"
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        return str(exc)
    return ""


def _snapshot(
    spec: str,
    what: str,
    repo_id: str,
    revision: str | None,
    *,
    local_only: bool,
    patterns: list[str] | None,
    why: Exception | None = None,
) -> Path:
    """``snapshot_download``, its errors made ``HubError``; ``why``: the reason the Hub is not
    asked (when not ``HF_HUB_OFFLINE``)."""
    from huggingface_hub import errors as hf
    from huggingface_hub import snapshot_download

    cache = _cache_dir()
    tried = (
        f"{_prefix(what)}no folder {_shown(Path(spec).expanduser())}; "
        f"Hub repo {_at(repo_id, revision)}"
    )
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=local_only,
            allow_patterns=patterns,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except (hf.RevisionNotFoundError, hf.GatedRepoError, hf.RepositoryNotFoundError) as exc:
        raise _refused(exc, tried, repo_id, revision) from exc
    except hf.LocalEntryNotFoundError as exc:  # not cached, and offline or the Hub unreachable
        offline = _offline()
        if offline:
            reason = "HF_HUB_OFFLINE is set"
        else:
            cause = why or exc.__cause__ or exc
            reason = f"the Hub could not be reached: {type(cause).__name__}: {cause}"
        raise HubError(
            f"{tried}: {_not_cached(repo_id, revision, cache)} ({reason}); fix: check "
            f"the path, or download it where the Hub is reachable (`hf download {repo_id}"
            f"{f' --revision {revision}' if revision else ''}`, with the same HF_HOME or "
            f"HF_HUB_CACHE){', or unset HF_HUB_OFFLINE' if offline else ''}"
        ) from exc
    except hf.HfHubHTTPError as exc:
        raise HubError(f"{tried}: the Hub answered {exc}") from exc
    except Exception as exc:  # an incomplete cached snapshot (IncompleteSnapshotError), ...
        if type(exc).__name__ != "IncompleteSnapshotError":  # (only in recent huggingface_hub)
            raise
        raise HubError(f"{tried}: {exc} (`hf download {repo_id}` completes it)") from exc
    return Path(folder)


def _not_cached(repo_id: str, revision: str | None, cache: Path) -> str:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    if not repo.is_dir():
        return f"not in the cache {cache}"
    refs = sorted(p.name for p in (repo / "refs").glob("*") if p.is_file())
    commits = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())
    return (
        f"the cache {cache} has the repo, but not at revision {revision or 'main'!r} (cached "
        f"branches and tags: {', '.join(refs) or 'none'}; commits: {', '.join(commits) or 'none'})"
    )


class _Unreachable(Exception):
    """The Hub API could not be asked (the cause says why); the cache may still answer."""


def _remote_files(repo_id: str, revision: str | None, what: str) -> tuple[str, list[str]]:
    """The commit and file names of a Hub repo at ``revision``, asked from the Hub's API."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf

    tried = f"{_prefix(what)}Hub repo {_at(repo_id, revision)}"
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        info = api.model_info(repo_id, revision=revision)
    except (hf.RevisionNotFoundError, hf.GatedRepoError, hf.RepositoryNotFoundError) as exc:
        raise _refused(exc, tried, repo_id, revision) from exc
    except Exception as exc:  # the transport's own errors differ between library versions
        raise _Unreachable() from exc
    return str(info.sha), [s.rfilename for s in info.siblings or ()]


# --------------------------------------------------------------------------------- helpers
def _refused(exc: Exception, tried: str, repo_id: str, revision: str | None) -> HubError:
    """The Hub's answer that a repo or revision is not there (or not for us), said plainly."""
    from huggingface_hub import errors as hf

    if isinstance(exc, hf.RevisionNotFoundError):
        return HubError(
            f"{tried}: the repo has no revision {revision!r}; give a branch, tag or commit that "
            f"exists (see https://huggingface.co/{repo_id}/tree/main)"
        )
    if isinstance(exc, hf.GatedRepoError):  # a RepositoryNotFoundError too: asked before it
        return HubError(
            f"{tried}: a gated repo; accept its terms on https://huggingface.co/{repo_id} and log "
            "in (`hf auth login`, or set HF_TOKEN)"
        )
    return HubError(
        f"{tried}: no such model repo on the Hub (or it is private: log in with "
        "`hf auth login` or set HF_TOKEN); check the path or the id, or give a local folder"
    )


def _missing(names: Collection[str], needs: Needs) -> str:
    """What of a ``needs`` is not among the file ``names`` ("" when nothing)."""
    top = {n for n in names if "/" not in n}
    if needs == "tokenizer":
        if not top.intersection(TOKENIZER_FILES):
            return f"tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
        return ""
    lacking = []
    if "config.json" not in top:
        lacking.append("config.json")
    if not any(fnmatch.fnmatch(n, p) for n in top for p in _WEIGHTS):
        lacking.append("weights (*.safetensors or pytorch_model*.bin)")
    return " and no ".join(lacking)


def _weights_in(folder: Path) -> bool:
    return any(any(folder.glob(p)) for p in _WEIGHTS)


def _offline() -> bool:
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return (value or "").upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> Path:
    """The Hub cache as huggingface_hub finds it, read now (not when it was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _prefix(what: str) -> str:
    return f"{what}: " if what else ""


def _at(repo_id: str, revision: str | None) -> str:
    return f"{repo_id!r} at revision {revision!r}" if revision else repr(repo_id)


def _shown(path: Path) -> str:
    return str(path) if path.is_absolute() else f"{path} (looked in {Path.cwd()})"
