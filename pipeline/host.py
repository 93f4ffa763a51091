"""Several stage replicas in one process: ``python -m pipeline.host LOG_FILE REPORT_FD``.

The local launcher starts one host for the replicas that share a process (``run.share_process``:
those that reserve no cores or GPUs and are not ranks of a gang) and drives it over its stdin,
one JSON object a line::

    {"start": "scorer.0", "spec": "RUN_DIR/specs/scorer.0.json"}   run a replica from its spec
    {"signal": "scorer.0", "sig": 15}                              SIGTERM/SIGINT: shut it down
    {"signal": "scorer.0", "sig": 9}                               SIGKILL: end it now

and the host answers on the pipe ``REPORT_FD`` (stdout and stderr are the replicas' raw
output), one line per replica that ended::

    {"exited": "scorer.0", "code": 0}

Each replica is what ``pipeline.actor`` makes of its spec (the same ``_Replica``: its own
sockets, ZeroMQ context, control-bus client, heartbeats, ledger reports), on this process's
event loop, with its own log file (``pipeline.structured_log.ReplicaLog``); what logs through
the process as a whole (the standard library's ``logging``, a bare ``structlog.get_logger()``)
goes to ``LOG_FILE``. Replicas of the host whose channels join them talk in-process
(``transport.local``: the supervisor marks those peers ``local`` in the specs).

A replica that raises ends alone: it exits 1 and its neighbours go on (its producers send
again what it held, as they would to a process that died); the supervisor restarts it under
its own policy by sending ``start`` again. A replica told SIGKILL ends at once (exit -9).
SIGTERM or SIGINT to the host, or its stdin closing (the launcher is gone), shuts every
replica down; the host exits once they all have.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pipeline import heap
from pipeline.actor import _Replica, _run_loop
from pipeline.processes import exit_now
from pipeline.structured_log import (
    ReplicaLog,
    close_process_logging,
    configure_process_logging,
)

__all__ = ["main"]


class _Host:
    def __init__(self, log: Any, report_fd: int) -> None:
        self.log = log
        self.report_fd = report_fd
        self.replicas: dict[str, _Replica] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def tell(self, event: dict[str, Any]) -> None:
        os.write(self.report_fd, (json.dumps(event) + "\n").encode())  # one line: atomic

    def start(self, name: str, spec_path: str) -> None:
        if name in self.tasks:
            self.log.error("host_start_refused", replica_name=name, detail="still running")
            return
        try:
            spec = json.loads(Path(spec_path).read_text())
        except (OSError, ValueError) as exc:
            self.log.error("host_bad_spec", replica_name=name, spec=spec_path, error=str(exc))
            self.tell({"exited": name, "code": 2})
            return
        self.tasks[name] = asyncio.create_task(self._run(name, spec), name=f"replica:{name}")

    async def _run(self, name: str, spec: dict[str, Any]) -> None:
        replica: _Replica | None = None
        log = ReplicaLog(
            Path(spec["log_file"]),
            stage=spec["stage"],
            replica=spec["replica"],
            level=spec["log_level"],
            version=lambda: replica.ctx.version if replica is not None else 0,
        )
        code = 1
        try:
            replica = _Replica(spec, log.logger, hosted=True)
            self.replicas[name] = replica
            code = await replica.main()
        except Exception:
            log.logger.exception("replica_crashed")
        finally:
            self.replicas.pop(name, None)
            self.tasks.pop(name, None)
            log.close()
            self.tell({"exited": name, "code": code})
            if code != 0 and self.replicas:  # it is restarted: what it held, some of it
                # frozen (pipeline.heap), is garbage once this task is done
                asyncio.get_running_loop().call_soon(heap.resettle)

    def signal(self, name: str, sig: int) -> None:
        replica = self.replicas.get(name)
        if replica is None:
            return  # ended already (or not started yet: the launcher only signals started ones)
        if sig == signal.SIGKILL:
            replica.kill()
        else:
            replica.request_shutdown(signal.Signals(sig).name)

    def shutdown(self, reason: str) -> None:
        for replica in list(self.replicas.values()):
            replica.request_shutdown(reason)

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown, signal.Signals(sig).name)
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            try:
                command = json.loads(line)
                if "start" in command:
                    self.start(str(command["start"]), str(command["spec"]))
                elif "signal" in command:
                    self.signal(str(command["signal"]), int(command["sig"]))
                else:
                    raise ValueError("neither start nor signal")
            except (ValueError, KeyError, TypeError) as exc:
                text = line[:200].decode(errors="replace")
                self.log.error("host_bad_command", command=text, error=str(exc))
        self.shutdown("launcher gone")  # our stdin closed: nobody is left to drive us
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m pipeline.host LOG_FILE REPORT_FD", file=sys.stderr)
        return 2
    log = configure_process_logging(Path(argv[0]), stage="host", replica=0)
    try:
        return _run_loop(_Host(log, int(argv[1])).serve())
    except Exception:
        log.exception("host_crashed")
        return 1
    finally:
        close_process_logging()


if __name__ == "__main__":
    exit_now(main())
