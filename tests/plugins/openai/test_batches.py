"""The Files and Batch APIs through the openai SDK (client.files, client.batches) against a real
server: results matched by custom_id, malformed lines in the error file, request_counts, cancel,
the bound on lines in flight, batch priority, a batch resumed after a restart (graceful and kill -9:
each line once), oversized uploads (413), and ``baton run-batch`` offline.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from baton_openai.batch import runner as batch_runner

from .conftest import metric, running_server, wait_for
from .probes import connect, read_response, request_bytes
from .test_lifecycle import ServeProcess

KEY = "batch-key"
RUN_BATCH = [sys.executable, "-m", "baton.cli.main", "run-batch"]
MESSAGES = [{"role": "user", "content": "Say something."}]


def chat_line(custom_id: str, model: str | None = None, **body: Any) -> str:
    body = {"messages": MESSAGES, "max_tokens": 4, **body}
    if model is not None:
        body["model"] = model
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def upload(client: openai.OpenAI, lines: list[str]) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def run_to_end(client: openai.OpenAI, lines: list[str], endpoint: str = "/v1/chat/completions"):
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=endpoint, completion_window="24h"
    )
    return wait_final(client, batch.id)


def wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 120.0):
    box: dict[str, Any] = {}

    def final() -> bool:
        box["b"] = client.batches.retrieve(batch_id)
        return box["b"].status in ("completed", "failed", "cancelled", "expired")

    wait_for(final, timeout, what=f"batch {batch_id} to end")
    return box["b"]


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def batch_server(model_dir, tmp_path_factory):
    files = tmp_path_factory.mktemp("files")
    with running_server(model_dir, **{"server.files_dir": str(files)}) as srv:
        yield srv


def test_six_line_batch_completes_with_six_outputs_matched_by_custom_id(batch_server):
    client = batch_server.client()
    ids = [f"req-{i}" for i in range(6)]
    lines = [chat_line(cid, batch_server.model, temperature=0) for cid in ids]
    batch = run_to_end(client, lines)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 6 and batch.request_counts.completed == 6
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    out = jsonl(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == ids
    for o in out:
        assert o["error"] is None and o["id"].startswith("batch_req_")
        assert o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] >= 1
        assert o["response"]["request_id"] == body["id"]
    # the same request over HTTP answers the same (temperature 0): a line is the endpoint's own
    direct = client.chat.completions.create(
        model=batch_server.model, messages=MESSAGES, max_tokens=4, temperature=0
    )
    assert {o["response"]["body"]["choices"][0]["message"]["content"] for o in out} == {
        direct.choices[0].message.content
    }
    listed = client.batches.list()
    assert batch.id in [b.id for b in listed.data]
    output = client.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.bytes > 0


def test_malformed_lines_go_to_the_error_file_and_the_rest_complete(batch_server):
    client = batch_server.client()
    lines = [
        chat_line("good-0"),
        "{not json",
        chat_line("bad-param", max_tokens=-1),
        json.dumps(
            {"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {}}
        ),
        json.dumps(
            {"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {}}
        ),
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"}),
        chat_line("streams", stream=True),
        chat_line("good-0"),  # a duplicate custom_id
        chat_line("too-long", max_tokens=10**6),
        chat_line("good-1"),
    ]
    batch = run_to_end(client, lines)
    assert batch.status == "completed"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (10, 2, 8)
    out = jsonl(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == ["good-0", "good-1"]
    errors = {e["custom_id"]: e for e in jsonl(client, batch.error_file_id)}
    assert len(jsonl(client, batch.error_file_id)) == 8
    assert errors[None]["error"]["code"] == "invalid_json" and errors[None]["response"] is None
    bad = errors["bad-param"]
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"
    assert bad["error"]["code"] == "invalid_value"
    assert errors["wrong-url"]["error"]["code"] == "invalid_url"
    assert errors["get"]["error"]["code"] == "invalid_method"
    assert "body" in errors["no-body"]["error"]["message"]
    assert "stream" in errors["streams"]["error"]["message"]
    assert errors["good-0"]["error"]["code"] == "duplicate_custom_id"
    assert errors["too-long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    # the server still serves
    assert client.completions.create(model=batch_server.model, prompt="hi", max_tokens=2).choices


@pytest.mark.parametrize(
    ("endpoint", "body", "kind"),
    [
        ("/v1/completions", {"prompt": "Once upon", "max_tokens": 3}, "text_completion"),
        ("/v1/embeddings", {"input": ["a cat", "a dog"]}, "list"),
    ],
)
def test_completions_and_embeddings_batches(batch_server, endpoint, body, kind):
    client = batch_server.client()
    lines = [
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": endpoint, "body": body})
        for i in range(3)
    ]
    batch = run_to_end(client, lines, endpoint)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    out = jsonl(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == ["c0", "c1", "c2"]
    assert all(o["response"]["body"]["object"] == kind for o in out)


def test_files_api_retrieve_content_list_delete(batch_server):
    client = batch_server.client()
    lines = [chat_line("x")]
    file_id = upload(client, lines)
    got = client.files.retrieve(file_id)
    assert (got.id, got.purpose, got.filename, got.bytes) == (
        file_id,
        "batch",
        "in.jsonl",
        len(lines[0]) + 1,
    )
    assert client.files.content(file_id).text == lines[0] + "\n"
    assert file_id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError) as e:
        client.files.retrieve(file_id)
    assert e.value.body["code"] == "file_not_found"
    for bad in ("..", "..%2F..%2Fetc%2Fpasswd", "file-" + "0" * 32, "x" * 300):
        r = httpx.get(f"{batch_server.url}/v1/files/{bad}/content", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", bad


def test_bad_batch_requests_are_400s_or_404s_naming_the_field(batch_server):
    client = batch_server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.create(
            input_file_id="file-" + "1" * 32,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    assert e.value.body["code"] == "file_not_found"
    file_id = upload(client, [chat_line("x")])
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/responses", completion_window="24h"
        )
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="1h"
        )
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("in.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    empty = client.files.create(file=("e.jsonl", io.BytesIO(b"\n\n")), purpose="batch")
    batch = client.batches.create(
        input_file_id=empty.id, endpoint="/v1/completions", completion_window="24h"
    )
    failed = wait_final(client, batch.id)
    assert failed.status == "failed" and failed.errors.data[0].code == "invalid_input_file"


def test_an_oversized_upload_is_a_413_in_openai_shape(model_dir, tmp_path):
    with running_server(
        model_dir,
        api_key=KEY,
        body_timeout=2.0,
        **{"server.files_dir": str(tmp_path), "server.max_file_bytes": "1KiB"},
    ) as srv:
        client = srv.client(api_key=KEY)
        with pytest.raises(openai.APIStatusError) as e:
            client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 200_000)), purpose="batch")
        assert e.value.status_code == 413
        assert "server.max_file_bytes" in e.value.body["message"]
        # without a Content-Length (chunked), the upload is cut off as it passes the limit
        boundary = "b0undary"
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"'
            "\r\nContent-Type: application/octet-stream\r\n\r\n"
        ).encode()

        def chunks():
            yield head
            for _ in range(200):
                yield b"y" * 1000

        form = {"content-type": f"multipart/form-data; boundary={boundary}"}
        auth = {"authorization": f"Bearer {KEY}"}
        r = httpx.post(f"{srv.url}/v1/files", content=chunks(), headers=form | auth, timeout=30)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        # a file just over the limit, in a body the framing lets through: the store refuses it
        with pytest.raises(openai.APIStatusError) as e:
            client.files.create(file=("a.jsonl", io.BytesIO(b"z" * 1500)), purpose="batch")
        assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
        # an upload that stops coming is a 408 after server.body_timeout
        sock = connect(srv.url)
        sock.sendall(
            request_bytes(
                "POST", "/v1/files", headers={"transfer-encoding": "chunked"} | form | auth
            )
        )
        sock.sendall(b"%x\r\n%s\r\n" % (len(head), head))
        r = read_response(sock)
        assert r.status == 408 and r.json()["error"]["code"] == "request_timeout"
        sock.close()
        assert client.files.list().data == []  # nothing half-stored
        assert [p.name for p in (tmp_path / "files").iterdir()] == []
        # the routes are behind the API key
        for call in (srv.client().files.list, srv.client().batches.list):
            with pytest.raises(openai.AuthenticationError):
                call()


def test_cancel_stops_the_lines_in_flight(model_dir, tmp_path):
    with running_server(
        model_dir, **{"server.files_dir": str(tmp_path), "server.batch_max_concurrency": 2}
    ) as srv:
        client = srv.client()
        lines = [chat_line(f"l{i}", max_tokens=600, ignore_eos=True) for i in range(8)]
        batch = client.batches.create(
            input_file_id=upload(client, lines),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        wait_for(
            lambda: metric(srv.metrics(), "baton_num_requests_running") >= 1,
            what="a line running",
        )
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = wait_final(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        assert done.request_counts.completed < 8
        wait_for(
            lambda: metric(srv.metrics(), "baton_num_requests_running") == 0,
            what="the lines aborted",
        )
        assert len(jsonl(client, done.output_file_id)) == done.request_counts.completed
        with pytest.raises(openai.BadRequestError):
            client.batches.cancel(run_to_end(client, [chat_line("z")]).id)


def test_a_batch_past_its_window_expires_with_every_line_answered_once(
    model_dir, tmp_path, monkeypatch
):
    monkeypatch.setitem(batch_runner.COMPLETION_WINDOW_S, "24h", 2)  # a 2 s window
    with running_server(
        model_dir, **{"server.files_dir": str(tmp_path), "server.batch_max_concurrency": 1}
    ) as srv:
        client = srv.client()
        lines = [chat_line(f"e{i}", max_tokens=400, ignore_eos=True) for i in range(12)]
        done = run_to_end(client, lines)
        assert done.status == "expired" and done.expired_at
        counts = done.request_counts
        assert counts.completed + counts.failed == counts.total == 12 and counts.failed >= 1
        out = jsonl(client, done.output_file_id)
        errors = jsonl(client, done.error_file_id)
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        assert Counter(o["custom_id"] for o in out + errors) == Counter(f"e{i}" for i in range(12))


def test_lines_in_flight_are_bounded_and_wait_behind_interactive_requests(model_dir, tmp_path):
    """batch_max_concurrency bounds what a batch puts in the engine; with the priority policy
    and two sequences at a time, an interactive request goes ahead of the waiting batch lines
    (fcfs would make it wait for all four)."""
    with running_server(
        model_dir,
        policy="priority",
        max_num_seqs=2,
        max_model_len=512,
        **{"server.files_dir": str(tmp_path), "server.batch_max_concurrency": 4},
    ) as srv:
        client = srv.client()
        lines = [chat_line(f"l{i}", max_tokens=150, ignore_eos=True) for i in range(6)]
        batch = client.batches.create(
            input_file_id=upload(client, lines),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        peak = {"n": 0.0}
        stop = threading.Event()

        interactive = threading.Event()  # its request is not counted
        # bumped when the interactive request starts and ends: a sample whose scrape overlapped
        # either (the flag read before the scrape, the request sent meanwhile) is dropped
        phase = [0]

        def watch() -> None:
            while not stop.is_set():
                seen = phase[0]
                if interactive.is_set():
                    time.sleep(0.02)
                    continue
                m = srv.metrics()
                if interactive.is_set() or phase[0] != seen:
                    continue
                n = metric(m, "baton_num_requests_running") + metric(
                    m, "baton_num_requests_waiting"
                )
                peak["n"] = max(peak["n"], n)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            wait_for(
                lambda: metric(srv.metrics(), "baton_num_requests_waiting") >= 2,
                what="batch lines waiting",
            )
            before = client.batches.retrieve(batch.id).request_counts.completed
            phase[0] += 1
            interactive.set()
            client.chat.completions.create(model=srv.model, messages=MESSAGES, max_tokens=2)
            interactive.clear()
            phase[0] += 1
            after = client.batches.retrieve(batch.id).request_counts.completed
            assert after - before <= 2, (before, after)  # at most the lines that were running
            final = wait_final(client, batch.id)
        finally:
            stop.set()
            watcher.join()
        assert final.request_counts.completed == 6
        assert 1 <= peak["n"] <= 4, peak


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_second_server_on_the_same_folder_is_refused(model_dir, tmp_path):
    folder = {"server.files_dir": str(tmp_path)}
    with running_server(model_dir, **folder), pytest.raises(RuntimeError) as e:  # noqa: SIM117
        with running_server(model_dir, **folder):
            pass
    assert "in use by another baton server" in str(e.value)


def test_a_batch_resumes_after_a_graceful_restart(model_dir, tmp_path):
    overrides = {
        "server.files_dir": str(tmp_path),
        "server.batch_max_concurrency": 2,
        "server.shutdown_timeout": 0,
    }
    lines = [chat_line(f"g{i}", max_tokens=120, ignore_eos=True) for i in range(8)]
    with running_server(model_dir, **overrides) as srv:
        client = srv.client()
        batch = client.batches.create(
            input_file_id=upload(client, lines),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        wait_for(
            lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1,
            what="a line done",
        )
    with running_server(model_dir, **overrides) as srv:
        client = srv.client()
        done = wait_final(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 8
        out = jsonl(client, done.output_file_id)
        assert Counter(o["custom_id"] for o in out) == Counter(f"g{i}" for i in range(8))


@pytest.mark.slow
def test_a_batch_killed_mid_way_resumes_and_answers_each_line_once(
    model_dir, tmp_path, monkeypatch
):
    """kill -9 while lines are in flight and results are being appended: the restarted server
    (same folder) finishes the batch, and every custom_id is in the output exactly once."""
    monkeypatch.setenv("BATON_SERVER__FILES_DIR", str(tmp_path))
    monkeypatch.setenv("BATON_SERVER__BATCH_MAX_CONCURRENCY", "4")
    args = ("--model", model_dir, "--max-model-len", "1024")
    serve = ServeProcess(*args)
    client = serve.client()
    model = client.models.list().data[0].id
    n = 24
    lines = [chat_line(f"k{i}", model, max_tokens=60, ignore_eos=True) for i in range(n)]
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_for(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3,
        timeout=120,
        what="some lines done",
    )
    serve.proc.send_signal(signal.SIGKILL)
    serve.wait(30)
    record = json.loads((tmp_path / "batches" / f"{batch.id}.json").read_text())
    output = tmp_path / "files" / f"{record['output_path_id']}.data"
    written = len(output.read_bytes().splitlines())
    assert record["status"] == "in_progress" and 3 <= written < n, written  # mid-batch
    serve = ServeProcess(*args)
    try:
        client = serve.client()
        done = wait_final(client, batch.id, timeout=180)
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
        out = jsonl(client, done.output_file_id)
        assert Counter(o["custom_id"] for o in out) == Counter(f"k{i}" for i in range(n))
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        serve.wait(60)


def test_run_batch_offline_in_vllms_format(model_dir, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        json.dumps(
            {
                "custom_id": "cmpl",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "Hello", "max_tokens": 3},
            }
        ),
        "not json",
        chat_line("chat"),
        json.dumps(
            {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}}
        ),
        chat_line("bad", temperature=-1),
    ]
    src.write_text("\n".join(lines) + "\n")
    r = subprocess.run(
        [
            *RUN_BATCH,
            "-i",
            str(src),
            "-o",
            str(dst),
            "--model",
            model_dir,
            "--max-model-len",
            "512",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "5 lines, 3 succeeded, 2 failed" in r.stderr
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["cmpl", None, "chat", "emb", "bad"]
    for o in out:
        assert set(o) == {"id", "custom_id", "response", "error"}
    assert out[0]["response"]["status_code"] == 200
    assert out[0]["response"]["body"]["object"] == "text_completion"
    assert out[1]["response"] is None and out[1]["error"]["code"] == "invalid_json"
    assert out[2]["response"]["body"]["object"] == "chat.completion"
    assert out[3]["response"]["body"]["data"][0]["object"] == "embedding"
    assert out[4]["response"]["status_code"] == 400
    assert out[4]["response"]["body"]["error"]["param"] == "temperature"
    missing = subprocess.run(
        [*RUN_BATCH, "-i", str(tmp_path / "nope"), "-o", str(dst), "--model", model_dir],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no input file" in missing.stderr


def test_batch_state_is_in_the_folder(batch_server):
    """What survives a restart is on disk: the batch record, msgspec JSON, next to the files."""
    client = batch_server.client()
    batch = run_to_end(client, [chat_line("s")])
    root = Path(batch_server.config.server.files_dir)
    record = json.loads((root / "batches" / f"{batch.id}.json").read_text())
    assert record["status"] == "completed" and record["output_file_id"] == batch.output_file_id
    assert (root / "files" / f"{batch.output_file_id}.data").exists()
