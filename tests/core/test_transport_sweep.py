"""Files of dead frontends are swept; files of live processes are kept."""

import os
import subprocess
import sys

from baton.transport.sweep import sweep_stale


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(proc.stdout)


def test_sweep_removes_only_what_dead_processes_left(tmp_path):
    dead = _dead_pid()
    (tmp_path / f"baton_{dead}_abc_e0").write_bytes(b"x")
    (tmp_path / f"baton_zmq_{dead}_abc").mkdir()
    (tmp_path / f"baton_zmq_{dead}_abc" / "in").write_bytes(b"")
    (tmp_path / f"baton_{os.getpid()}_live_e0").write_bytes(b"x")  # ours: alive
    (tmp_path / "baton_unrelated").write_bytes(b"x")  # no pid in the name

    removed = sweep_stale(str(tmp_path), "baton_")

    assert sorted(os.path.basename(p) for p in removed) == sorted(
        [f"baton_{dead}_abc_e0", f"baton_zmq_{dead}_abc"]
    )
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"baton_{os.getpid()}_live_e0", "baton_unrelated"]
    )
