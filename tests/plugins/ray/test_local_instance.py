"""With no ``address`` and no Ray in the process, the executor starts a local Ray instance
for itself, on the loopback, and stops it on shutdown (a fresh interpreter: this test
process is connected to the package's cluster)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

SCRIPT = textwrap.dedent(
    """
    import ray
    from baton import LLM, SamplingParams
    from baton.testing.tiny_model import tiny_model

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(3, 30))}]
    with LLM(model=str(tiny_model("llama")), device="cpu", num_threads=1) as llm:
        ref = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(model=str(tiny_model("llama")), device="cpu", num_threads=1, executor="ray",
              tensor_parallel_size=2)
    assert ray.is_initialized()
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    assert not ray.is_initialized(), "the executor started Ray: it stops it"
    assert out == ref, (out, ref)
    print("OK", len(out))
    """
)


def ray_daemons() -> set[int]:
    out = set()
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "raylet" in cmd or "gcs_server" in cmd:
            out.add(p.pid)
    return out


@pytest.mark.slow
def test_a_local_ray_instance_is_started_and_stopped():
    before = ray_daemons()
    env_free = {k: v for k, v in __import__("os").environ.items() if k != "RAY_ADDRESS"}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=280, env=env_free
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "OK 8" in res.stdout
    deadline = time.monotonic() + 10
    while ray_daemons() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_daemons() - before, "the local instance's daemons outlived the executor"
