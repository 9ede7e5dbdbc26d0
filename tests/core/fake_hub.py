"""A Hugging Face Hub stand-in on 127.0.0.1: the few routes huggingface_hub's snapshot_download
uses (the revision's file tree and each file's resolve URL), serving local folders as repos.

Real HTTP and the real huggingface_hub client: only the server is ours. It answers every
revision with one commit, and records each path it was asked for.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.files = {
            repo: {p.relative_to(d).as_posix(): p for p in sorted(d.rglob("*")) if p.is_file()}
            for repo, d in repos.items()
        }
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", **headers: str) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k.replace("_", "-"), v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _route(self) -> None:
                path = self.path.split("?")[0]
                hub.requests.append(f"{self.command} {path}")
                m = re.match(r"^/api/models/([^/]+/[^/]+)(/tree/[^/]+|/revision/[^/]+)?", path)
                if m:
                    files = hub.files.get(m.group(1))
                    if files is None:
                        self._send(
                            404, b'{"error": "Repository not found"}', X_Error_Code="RepoNotFound"
                        )
                    elif (m.group(2) or "").startswith("/tree/"):
                        tree = [
                            {"type": "file", "path": f, "size": p.stat().st_size, "oid": _sha1(p)}
                            for f, p in files.items()
                        ]
                        self._send(200, json.dumps(tree).encode(), Content_Type="application/json")
                    else:
                        info = {
                            "id": m.group(1),
                            "sha": COMMIT,
                            "siblings": [{"rfilename": f} for f in files],
                        }
                        self._send(200, json.dumps(info).encode(), Content_Type="application/json")
                    return
                m = re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", path)
                files = hub.files.get(m.group(1)) if m else None
                if not m or files is None or m.group(2) not in files:
                    self._send(404, b"not found", X_Error_Code="EntryNotFound")
                    return
                p = files[m.group(2)]
                self._send(200, p.read_bytes(), X_Repo_Commit=COMMIT, ETag=f'"{_sha1(p)}"')

            do_GET = do_HEAD = _route

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _sha1(p: Path) -> str:
    return hashlib.sha1(p.read_bytes()).hexdigest()
