"""Topics of the control bus (PUB/SUB through the supervisor's broker) and their payloads.

- ``heartbeat`` {stage, replica, pid, session, held}: every ``run.heartbeat_s`` from each replica
  (``held``: messages waiting in its inboxes; if it dies their producers send them again).
- ``version`` {version, engines, stage, replica}: a new policy version is live (from the weight
  publisher); ``engines``: the URLs that have loaded it (generators learn their engines' versions
  here without asking them). The supervisor re-sends the latest one every heartbeat so late
  joiners learn it.
- ``stop`` {stage, replica, session, reason, outcome}: a replica asks the supervisor to end the
  run, as ``succeeded`` or ``failed`` (``outcome``); refused unless it comes from a live replica.

Every message carries the sender's ``stage``, ``replica`` and ``session`` and is signed with the
run's key (see ``transport.control``).
- ``shutdown`` {reason}: from the supervisor; every replica stops its stage and exits.
- ``done`` {replicas: [stage.replica, ...]}: replicas that finished (exit 0, so every output was
  closed with end-of-stream); re-sent every heartbeat. A consumer restarted after its producer
  finished never sees that producer's end-of-stream, so it learns it here.
- ``engines`` {stage, replica, urls, epoch}: the inference engines a generator replica uses
  (``epoch`` grows when one of them was restarted, so its weights must be sent again); the
  supervisor re-sends the latest of each replica every heartbeat. The weight publisher reads it.
- ``ledger`` {stage, replica, session, ...}: where prompts and samples went (``pipeline.ledger``);
  only the supervisor listens.
- ``addresses`` {inboxes: {"stage.replica.port": address}}: from the supervisor, where every
  inbox is bound, when replicas bind on their own node (the Ray launcher: each binds port 0 and
  names the address in its heartbeats, ``inboxes``); re-sent every heartbeat. Producers connect
  their peers there, and move when a consumer restarts elsewhere.
- ``pace`` {stage, replica, rank, batch, every, max_lag, version, origins}: from each learner rank
  after each step: its batch size, ``publish.every``, ``max_lag``, the version its staleness check
  compares with, and how many generator sessions fed it lately. Generators keep what the learner
  is not done with within what it trains in ``max_lag`` versions (``No wasted work`` in
  DESIGN.md; ``stages.generator.controller``).
- ``summary`` {stage, replica, values}: values for ``RUN_DIR/summary.json``; the supervisor merges
  them (later values win) and writes the file, with the run's status and wall time, at the end.
"""

HEARTBEAT = "heartbeat"
VERSION = "version"
STOP = "stop"
SHUTDOWN = "shutdown"

DONE = "done"
ENGINES = "engines"
SUMMARY = "summary"
ADDRESSES = "addresses"
LEDGER = "ledger"
PACE = "pace"
