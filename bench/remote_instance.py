"""How fast a new engine comes up on a running engine's weights (``--load-format
remote_instance``, ``stages/engine/remote_instance.py``) against loading its checkpoint.

A random Qwen2-shaped model (``--hidden``, ``--layers``; 1024 and 16 are about 0.3B parameters)
is saved in float32; a seed engine serves it and then loads other weights (``/weights_checker``
``reset_tensors``) under a new weight version, as a running RL job's engine holds weights no
checkpoint has. Each round starts a new engine from the checkpoint and one from the seed,
alternated, and reports:

- ``up_s``: seconds from the process's start to its ``/health`` answering, for each;
- ``transfer_s`` and ``gb_per_s``: the remote load's own exchange (its log's
  ``weights_from_remote_instance``: the group made, every parameter received);
- ``seed_longest_gap_s``: the longest wait between two answers the seed gave a client that
  kept asking for 8 tokens while a new engine started, from disk (the cores shared with a
  start) and from the seed (the same, and the send: the seed sends from a thread of its own
  and decodes on, so a gap as long as the transfer would say it stopped to send);
- ``same_weights``: the new engine's ``/weights_checker`` digests equal the seed's, and its
  ``weight_version`` is the seed's.

    python bench/remote_instance.py [--hidden 1024] [--layers 16] [--rounds 3]

Prints one JSON line: medians with min and max.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._engines import engine_server, free_port, make_model, spread  # noqa: E402

_MODULE = ("pipeline.cli", "engine")


def _checksums(url: str) -> dict[str, str]:
    answer = requests.post(url + "/weights_checker", json={"action": "checksum"}, timeout=120)
    answer.raise_for_status()
    return answer.json()["ranks"][0]["checksums"]


def _up(model: Path, flags: list[str], log: Path) -> tuple[float, str, Any]:
    """Start an engine; seconds until healthy, its URL and its context (left open)."""
    out = log.open("ab")
    started = time.monotonic()
    context = engine_server(model, "--skip-tokenizer-init", *flags, module=_MODULE, output=out)
    url, _ = context.__enter__()
    return time.monotonic() - started, url, (context, out)


def _down(handle: Any) -> None:
    context, out = handle
    context.__exit__(None, None, None)
    out.close()


def _decode_while(url: str, stop: threading.Event, answered: list[float]) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    while not stop.is_set():
        answer = requests.post(url + "/generate", json=body, timeout=120)
        assert len(answer.json()["output_ids"]) == 8
        answered.append(time.monotonic())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        params = make_model(folder, hidden=args.hidden, layers=args.layers, tied=False)
        seed_log = Path(scratch) / "seed.log"
        with (
            seed_log.open("ab") as out,
            engine_server(folder, "--skip-tokenizer-init", module=_MODULE, output=out) as (seed, _),
        ):
            requests.post(seed + "/weights_checker", json={"action": "reset_tensors"}, timeout=120)
            requests.post(seed + "/update_weight_version", json={"new_version": "s1"}, timeout=30)
            want = _checksums(seed)
            disk, remote, transfer, same = [], [], [], True
            gaps: dict[str, list[float]] = {"from_disk": [], "from_seed": []}
            flags = [
                "--load-format",
                "remote_instance",
                "--remote-instance-weight-loader-seed-instance-ip",
                "127.0.0.1",
                "--remote-instance-weight-loader-seed-instance-service-port",
                seed.rsplit(":", 1)[1],
                "--remote-instance-weight-loader-send-weights-group-ports",
            ]
            for r in range(args.rounds):
                log = Path(scratch) / f"new{r}.log"
                for kind in ("from_disk", "from_seed"):
                    more = [*flags, f"[{free_port()}]"] if kind == "from_seed" else []
                    stop, answered = threading.Event(), []
                    client = threading.Thread(target=_decode_while, args=(seed, stop, answered))
                    client.start()
                    try:
                        took, url, handle = _up(folder, more, log)
                    finally:
                        stop.set()
                        client.join()
                    gaps[kind].append(max(b - a for a, b in itertools.pairwise(answered)))
                    try:
                        (remote if kind == "from_seed" else disk).append(took)
                        if kind == "from_seed":
                            version = requests.get(url + "/get_weight_version", timeout=30)
                            same = (
                                same
                                and _checksums(url) == want
                                and version.json()["weight_version"] == "s1"
                            )
                    finally:
                        _down(handle)
                found = re.findall(
                    r"weights_from_remote_instance .*?seconds=([0-9.]+)", log.read_text()
                )
                transfer.append(float(found[-1]))
    nbytes = params * 4
    print(
        json.dumps(
            {
                "bench": "remote_instance",
                "params": params,
                "rounds": args.rounds,
                "up_s": {"from_disk": spread(disk), "from_seed": spread(remote)},
                "transfer_s": spread(transfer),
                "gb_per_s": spread([nbytes / t / 1e9 for t in transfer]),
                "seed_longest_gap_s": {k: spread(v) for k, v in gaps.items()},
                "same_weights": same,
            }
        )
    )


if __name__ == "__main__":
    main()
