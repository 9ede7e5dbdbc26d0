"""Fixtures for end-to-end tests: the tiny model, greedy references, leak checks for engine
processes and shared memory."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from baton import LLM, SamplingParams
from baton.processes import is_helper
from baton.testing.tiny_model import tiny_model


@pytest.fixture(scope="module")
def model_dir() -> str:
    """The tiny random llama (built once per session, on disk)."""
    return str(tiny_model("llama"))


def greedy_reference(
    model_dir: str, prompts: list[str], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    """Each prompt's tokens from a plain in-process LLM: what every other path must give."""
    with LLM(model=model_dir, max_model_len=256) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_a_death_fails_every_call(
    llm: LLM, killed_at: list[float], dead: type[BaseException], max_tokens: int = 2000
) -> None:
    """A long run (``max_tokens`` each), during which a process of the engine is killed
    (``killed_at``: when, filled by the killer at the first output), raises ``dead`` within
    5 s of the kill; so does every later call."""
    with pytest.raises(dead):
        llm.generate(
            ["x " * 10] * 4,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
            use_tqdm=False,
        )
    assert killed_at and time.monotonic() - killed_at[0] < 5.0
    with pytest.raises(dead):  # and every later call
        llm.generate("again", SamplingParams(max_tokens=2), use_tqdm=False)


def _shm_segments() -> set[str]:
    """baton's /dev/shm segments, except those of a live frontend outside this process's tree
    (another pytest-xdist worker's: a segment's name starts ``baton_<frontend pid>_``)."""
    try:
        names = {n for n in os.listdir("/dev/shm") if n.startswith("baton")}
    except FileNotFoundError:
        return set()
    ours = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}

    def foreign(name: str) -> bool:
        pid = name.split("_")[1] if name.count("_") >= 2 else ""
        return pid.isdigit() and int(pid) not in ours and psutil.pid_exists(int(pid))

    return {n for n in names if not foreign(n)}


def _children() -> list[psutil.Process]:
    """Live descendants, except multiprocessing's resource tracker and forkserver (they live as
    long as we do)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not is_helper(p):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def no_leaks():
    """Fail if a test leaves child processes or baton /dev/shm segments behind."""
    before = _shm_segments()
    yield
    deadline = time.monotonic() + 10
    while _children() and time.monotonic() < deadline:
        time.sleep(0.1)
    stray = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in _children()]
    assert not stray, f"stray processes after the test: {stray}"
    leaked = _shm_segments() - before
    assert not leaked, f"leaked /dev/shm segments: {sorted(leaked)}"
