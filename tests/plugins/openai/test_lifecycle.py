"""Engine death (503s, exit code 1) and SIGTERM (in-flight streams drain, exit code 0).

The in-thread server tests death over zmq (the engine is a child process to
kill); the signal tests run the real ``baton serve`` command in a subprocess.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import psutil
import pytest

from baton.processes import is_helper

from .conftest import ServerThread, metric, wait_for

MESSAGES = [{"role": "user", "content": "Go on and on."}]


def test_engine_death_turns_into_503s_and_exit_code_1(model_dir):
    srv = ServerThread(model=model_dir, max_model_len=1024, transport="zmq")
    try:
        client = srv.client()
        engine_pid = srv.server.engine.engine.resources.procs[0].pid
        outcome: dict[str, BaseException] = {}

        def waiting_for_a_full_answer() -> None:
            try:
                client.chat.completions.create(
                    model=srv.model,
                    messages=MESSAGES,
                    max_tokens=900,
                    extra_body={"ignore_eos": True},
                )
            except BaseException as e:
                outcome["error"] = e

        t = threading.Thread(target=waiting_for_a_full_answer)
        t.start()
        stream = iter(
            client.chat.completions.create(
                model=srv.model,
                messages=MESSAGES,
                max_tokens=900,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        next(stream)
        wait_for(
            lambda: metric(srv.metrics(), "baton_num_requests_running") == 2,
            what="both requests running",
        )
        os.kill(engine_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine"):
            for _ in stream:
                pass
        t.join(30)
        err = outcome["error"]
        assert isinstance(err, openai.InternalServerError) and err.status_code == 503, err
        assert err.body["code"] == "engine_unavailable"
        srv.thread.join(30)
        assert not srv.thread.is_alive(), "the server kept running with a dead engine"
        assert srv.exit_code == 1
    finally:
        if srv.thread.is_alive():
            srv.stop()


# ---------------------------------------------------------------------- `baton serve` in a subprocess


class ServeProcess:
    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli.main", "serve", "--port", "0", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_for_url()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def _wait_for_url(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                return m.group(1)
        self.proc.kill()
        raise AssertionError("baton serve did not start:\n" + "".join(self.log[-40:]))

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def engine_pids(self) -> list[int]:
        return [
            c.pid
            for c in psutil.Process(self.proc.pid).children(recursive=True)
            if not is_helper(c)
        ]

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def test_sigterm_drains_in_flight_streams_then_exits_0(model_dir):
    serve = ServeProcess(
        "--model",
        model_dir,
        "--max-model-len",
        "1024",
        "--transport",
        "zmq",
        "--shutdown-timeout",
        "60",
    )
    engines = serve.engine_pids()
    assert engines
    model = next(m.id for m in serve.client().models.list().data)
    stream = iter(
        serve.client().completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=150,
            stream=True,
            temperature=0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    next(stream)
    serve.proc.send_signal(signal.SIGTERM)
    chunks = list(stream)  # the stream keeps going to its end
    assert chunks[-1].usage.completion_tokens == 150
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["length"]
    assert serve.wait() == 0, "".join(serve.log[-30:])
    for pid in engines:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_engine_death_stops_baton_serve_with_exit_code_1(model_dir):
    serve = ServeProcess("--model", model_dir, "--max-model-len", "256", "--transport", "zmq")
    (engine,) = serve.engine_pids()
    os.kill(engine, signal.SIGKILL)
    assert serve.wait() == 1, "".join(serve.log[-30:])
    assert any("engine" in line and "died" in line for line in serve.log)
