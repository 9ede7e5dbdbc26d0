"""baton.processes: how engine and worker processes start (forkserver or spawn)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import psutil
import pytest

from baton import processes
from baton.errors import ConfigError


def _report(queue: multiprocessing.Queue, key: str) -> None:  # type: ignore[type-arg]
    queue.put((os.environ.get(key), psutil.Process().name(), os.getppid()))


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_started_process_has_the_current_environment_and_its_name(method, monkeypatch):
    monkeypatch.setenv(processes.START_METHOD_ENV, method)
    ctx = processes.context()
    for value in ("first", "second"):  # the second after the forkserver started
        monkeypatch.setenv("BATON_TEST_PROCESSES", value)
        queue = ctx.Queue()
        p = processes.start(_report, (queue, "BATON_TEST_PROCESSES"), name="baton-test-proc")
        seen, name, ppid = queue.get(timeout=120)
        p.join(30)
        assert p.exitcode == 0
        assert seen == value and name == "baton-test-proc"
        if method == "spawn":
            assert ppid == os.getpid()
        else:  # forked by the forkserver, which is our child and a helper
            server = psutil.Process(ppid)
            assert server.ppid() == os.getpid() and processes.is_helper(server)
            assert not processes.is_helper(psutil.Process(p.pid)) if p.is_alive() else True


def test_the_start_method_is_checked(monkeypatch):
    monkeypatch.setenv(processes.START_METHOD_ENV, "fork")
    with pytest.raises(ConfigError, match=r"BATON_START_METHOD='fork'.*forkserver or spawn"):
        processes.context()
    monkeypatch.delenv(processes.START_METHOD_ENV)
    assert processes.start_method() in ("forkserver", "spawn")


def test_alive():
    assert processes.alive(os.getpid())
    p = multiprocessing.get_context("spawn").Process(target=os.getpid)
    p.start()
    p.join(60)
    assert not processes.alive(p.pid)


UNGUARDED = """
from baton import processes


def noop():
    pass


p = processes.start(noop, (), name="baton-unguarded")  # at import: no __main__ guard
p.join(120)
print("exitcode", p.exitcode)
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_script_without_the_main_guard_is_told_to_add_it(method, tmp_path):
    """The child imports the script again; its own start is refused with the fix, by name."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, processes.START_METHOD_ENV: method}
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240
    )
    assert "exitcode 1" in run.stdout, (run.stdout, run.stderr)
    assert "ConfigError" in run.stderr and 'if __name__ == "__main__":' in run.stderr
