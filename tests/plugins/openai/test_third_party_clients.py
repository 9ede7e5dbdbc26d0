"""Clients nobody here wrote against the real ``baton serve`` command (issue 16):
lm-evaluation-harness with ``local-completions`` on a multiple-choice task and
``local-chat-completions`` on a generation task, both from the JSONL files of
``lm_eval_tasks/`` (through ``lm_eval.simple_evaluate``, what its CLI calls), and guidellm's
load generator (its CLI).

With the tiny random model the scores mean nothing, so what lm-eval computed is checked
against transformers: each choice's log-likelihood (echo + logprobs) and each greedy
answer. The real default model must beat chance on the easy multiple-choice set.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from baton.testing.tiny_model import tiny_model

TASKS = Path(__file__).parent / "lm_eval_tasks"
#: baton's paged attention (float32, CPU) against transformers' eager forward, summed over a
#: continuation's few tokens
LOGPROB_TOLERANCE = 1e-3
#: a third-party CLI run (its imports are most of it) may take this long on a loaded 2-core host
CLIENT_TIMEOUT_S = 240


class BatonServe:
    """The ``baton serve`` command in a subprocess on 127.0.0.1, a free port."""

    def __init__(self, *args: str, timeout: float = 180) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli.main", "serve", "--port", "0", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.log: list[str] = []
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                m = re.search(r"listening on (http://\S+)", lines.get(timeout=0.5))
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if m:
                self.url = m.group(1)
                return
        self.stop()
        raise AssertionError("baton serve did not start:\n" + "".join(self.log[-40:]))

    def _read(self, lines: queue.Queue[str]) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            lines.put(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_client(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    """Run a client's command line; its output, or an AssertionError with the output's end."""
    r = subprocess.run(
        argv,
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        check=False,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{argv[0]} exited with {r.returncode}:\n{out[-4000:]}"
    return out


def lm_eval(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    model: str,
    model_args: dict[str, Any],
    task: str,
    **kwargs: Any,
) -> tuple[dict, list[dict]]:
    """lm-eval's ``simple_evaluate`` (what its CLI runs) on one task of lm_eval_tasks/: the
    task's results and its samples. In this process, and with only these tasks indexed: the
    CLI would spend ~20 s indexing lm-eval's thousands of built-in tasks first."""
    datasets = pytest.importorskip("datasets")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the task YAMLs name their data files relative to it
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    out = simple_evaluate(
        model=model,
        model_args=args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
        **kwargs,
    )
    assert out is not None
    samples = out["samples"][task]
    assert out["n-samples"][task]["effective"] == len(samples)
    return out["results"][task], samples


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tiny_serve(tiny_dir: Path) -> Iterator[BatonServe]:
    serve = BatonServe(
        "--model", str(tiny_dir), "--served-model-name", "tiny", "--max-model-len", "1024"
    )
    try:
        yield serve
    finally:
        serve.stop()


def completions_args(
    serve: BatonServe, model: str, tokenizer: Path, tokenized_requests: bool = True
) -> dict[str, Any]:
    """local-completions' arguments: the tokenizer lm-eval splits context and continuation
    with, and whether it sends token ids (True) or texts that baton tokenizes (False)."""
    return {
        "model": model,
        "base_url": f"{serve.url}/v1/completions",
        "tokenizer": str(tokenizer),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": tokenized_requests,
        "num_concurrent": 2,
        "max_retries": 1,
    }


@pytest.mark.parametrize("tokenized_requests", [True, False], ids=["token-ids", "texts"])
def test_lm_eval_local_completions_scores_choices_as_transformers(
    monkeypatch, tmp_path, tiny_serve, tiny_dir, tokenized_requests
):
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    got, samples = lm_eval(
        monkeypatch,
        tmp_path,
        "local-completions",
        completions_args(tiny_serve, "tiny", tiny_dir, tokenized_requests),
        "baton_mc",
        batch_size=8,
    )
    assert got["sample_len"] == len(samples) == 20
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    correct = []
    for sample in samples:
        want = []
        for i, (resp,) in enumerate(sample["resps"]):
            context, continuation = sample["arguments"][i]
            # lm-eval's split: the whole text's tokens after the context's
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            ids = tok(context + continuation, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            total = sum(float(lp[j - 1, ids[j]]) for j in range(len(ctx), len(ids)))
            greedy = all(int(lp[j - 1].argmax()) == ids[j] for j in range(len(ctx), len(ids)))
            assert resp[0] == pytest.approx(total, abs=LOGPROB_TOLERANCE), sample["doc"]
            assert resp[1] == greedy
            want.append(total)
        correct.append(max(range(len(want)), key=want.__getitem__) == sample["doc"]["answer"])
    assert got["acc,none"] == pytest.approx(sum(correct) / len(correct))


def test_lm_eval_local_chat_completions_generates_as_transformers(
    monkeypatch, tmp_path, tiny_serve, tiny_dir
):
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = {
        "model": "tiny",
        "base_url": f"{tiny_serve.url}/v1/chat/completions",
        "num_concurrent": 2,
        "max_retries": 1,
    }
    got, samples = lm_eval(
        monkeypatch, tmp_path, "local-chat-completions", args, "baton_gen", apply_chat_template=True
    )
    assert got["sample_len"] == len(samples) == 8
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    for sample in samples:
        ((answer,),) = [sample["resps"][0]]
        # lm-eval's chat prompt is its JsonChatStr: the messages as JSON
        messages = json.loads(sample["arguments"][0][0].prompt)
        gen_kwargs = sample["arguments"][0][1]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=gen_kwargs["max_gen_toks"],
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        text = tok.decode(out[0, len(ids) :], skip_special_tokens=True).split("\n")[0]
        assert answer == text, sample["doc"]
    matches = [float(s["filtered_resps"][0].lower() == s["target"].lower()) for s in samples]
    assert got["exact_match,last_word"] == pytest.approx(sum(matches) / len(matches))


@pytest.mark.slow
@pytest.mark.timeout(600)  # the default model's start and ~100 requests, on a loaded host
def test_lm_eval_real_model_beats_chance_on_easy_questions(
    monkeypatch, tmp_path, default_model_dir
):
    pytest.importorskip("lm_eval")
    serve = BatonServe("--served-model-name", "smollm2")
    try:
        mc, mc_samples = lm_eval(
            monkeypatch,
            tmp_path,
            "local-completions",
            completions_args(serve, "smollm2", default_model_dir),
            "baton_mc",
            batch_size=8,
        )
        chat_args = {
            "model": "smollm2",
            "base_url": f"{serve.url}/v1/chat/completions",
            "num_concurrent": 4,
            "max_retries": 1,
        }
        gen, gen_samples = lm_eval(
            monkeypatch,
            tmp_path,
            "local-chat-completions",
            chat_args,
            "baton_gen",
            apply_chat_template=True,
        )
    finally:
        serve.stop()
    # 4 choices: chance is 0.25, and 10 of 20 right by chance has a probability of 1.4%
    # (SmolLM2-135M-Instruct answered 16 of 20 when this test was written, 7 of 8 of baton_gen:
    # "The capital of France is Paris.")
    assert len(mc_samples) == 20 and mc["acc,none"] >= 0.5, mc
    assert len(gen_samples) == 8 and gen["exact_match,last_word"] >= 0.5, gen


def test_guidellm_reports_every_request_succeeded(tmp_path, tiny_serve, tiny_dir):
    pytest.importorskip("guidellm")
    guidellm_bin = shutil.which("guidellm", path=str(Path(sys.executable).parent))
    assert guidellm_bin is not None
    report = tmp_path / "guidellm.json"
    run_client(
        [
            guidellm_bin,
            "run",
            "--backend",
            f"kind=openai_http,target={tiny_serve.url}",
            "--profile",
            "kind=concurrent,streams=4",
            "--constraint",
            "kind=max_requests,count=8",
            "--data",
            "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
            "--tokenizer",
            f"kind=huggingface_auto,model={tiny_dir}",
            "--output",
            f"kind=json,path={report}",
            "--disable-progress",
        ],
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1"},
    )
    (bench,) = json.loads(report.read_text())["benchmarks"]
    metrics = bench["metrics"]
    assert bench["config"]["backend"]["request_format"] == "/v1/chat/completions"
    assert metrics["request_totals"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    # every answer streamed the 16 tokens asked for, as baton counted them
    assert metrics["output_token_count"]["successful"]["mean"] == 16
    assert metrics["output_token_count"]["successful"]["count"] == 8
