"""Hugging Face caches written by hand, so tests find models and datasets "from the Hub" offline.

``save_to_hub_cache(folder, cache, "org/name", commit, refs=("main",))`` lays a local model
folder out the way ``huggingface_hub`` leaves a download: ``models--org--name/blobs/<sha256>``,
``snapshots/<commit>/<file>`` symlinks to the blobs, and ``refs/<branch>`` holding the commit.
``save_dataset_to_cache(files, cache, "org/name", config, commit)`` prepares a dataset the way
an online ``datasets.load_dataset("org/name", config)`` leaves it in ``HF_DATASETS_CACHE``
(``org___name/<config>/0.0.0/<commit>/name-<split>.arrow``, by the same Parquet builder). The
``offline`` helper points every cache at ``tmp_path`` and turns the network off, in the
environment (for subprocesses) and in the already-imported libraries (which read it at import).

What this cannot show is the download itself: no test here reaches the Hub.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest

__all__ = ["offline", "save_dataset_to_cache", "save_to_hub_cache"]


def save_to_hub_cache(
    folder: Path, cache: Path, repo_id: str, commit: str, refs: Iterable[str] = ("main",)
) -> Path:
    """Copy ``folder``'s files into ``cache`` as the snapshot ``commit`` of ``repo_id``; returns
    the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def save_dataset_to_cache(
    files: dict[str, Path], cache: Path, repo_id: str, config: str, commit: str
) -> Path:
    """Prepare the Parquet ``files`` (split -> file) as ``repo_id``'s configuration ``config``
    at ``commit`` in the datasets cache ``cache``; returns the prepared folder."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, name = repo_id.split("/")
    builder = Parquet(
        cache_dir=str(cache),
        dataset_name=name,
        config_name=config,
        config_id=config,
        hash=commit,
        data_files={split: str(path) for split, path in files.items()},
    )
    builder.download_and_prepare()
    # online, the builder knows the repo id and writes under namespace___name; offline it cannot
    # be given one (its data files must then be hf:// paths), so the folder is moved there
    shutil.move(str(cache / name), str(cache / f"{namespace}___{name}"))
    return cache / f"{namespace}___{name}" / config / "0.0.0" / commit


def offline(monkeypatch: pytest.MonkeyPatch, home: Path) -> Path:
    """``HF_HOME=home``, Hub cache ``home/hub``, datasets cache ``home/datasets``, no network;
    returns the Hub cache."""
    import datasets
    import huggingface_hub.constants

    hub = home / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    for var, value in {
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(hub),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    return hub
