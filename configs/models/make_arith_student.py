"""Make ``configs/models/arith-student``: the student of the on-policy distillation example
(``configs/distill.yaml``), which learns the default task with ``arith-tiny`` as its teacher.

Usage (from the repository root; about 15 s on one CPU thread)::

    python configs/models/make_arith_student.py [--out configs/models/arith-student]

It is ``make_arith_model.py`` (same task, same character tokenizer, same supervised warm start
on the task's train split, same stop rule) with a smaller shape and an earlier stop: hidden 64,
2 layers, MLP 256 (124K parameters, half of arith-tiny's 248K; an eighth, hidden 32 and MLP 128,
learned too slowly from any teacher to say anything), stopped as soon as its greedy accuracy on
the held-out sample lies in [0.25, 0.40], where arith-tiny stops in [0.52, 0.60]. So the
student starts well below its teacher (``arith-teacher``, ``make_arith_teacher.py``) and can
learn from it, yet right often enough that the reward alone also teaches it (a random student
would almost never be rewarded, and the comparison with distillation would say nothing). It
shares the teacher's tokenizer, as distillation needs. Any option of ``make_arith_model.py``
given here wins over these.
"""

from __future__ import annotations

import sys
from pathlib import Path

from make_arith_model import main

STUDENT = [
    *("--out", str(Path(__file__).parent / "arith-student")),
    *("--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2"),
    *("--intermediate", "256", "--min-acc", "0.25", "--max-acc", "0.40"),
]

if __name__ == "__main__":
    sys.exit(main([*STUDENT, *sys.argv[1:]]))
