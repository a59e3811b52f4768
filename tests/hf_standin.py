"""A stand-in for the Hugging Face Hub's file endpoint: just enough for `huggingface_hub.hf_hub_download`.

It answers HEAD and GET on /{repo}/resolve/{revision}/{filename} with the headers the client checks
(huggingface_hub/file_download.py, `get_hf_file_metadata` and `_get_metadata_or_catch_error`):
X-Repo-Commit (required), ETag (the file's sha256, as the Hub gives for LFS files) and Content-Length.
A file is also served at the commit X-Repo-Commit names, as the Hub serves it at its resolved revision.
Unknown files get 404 with X-Error-Code: EntryNotFound, as on the Hub. `stall_after` holds a body back
after that many bytes until `resume` is set, so a test can interrupt a download part-way.
"""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_CHUNK = 64 * 1024


class HubStandIn:
    def __init__(self):
        self.files: dict[str, bytes] = {}  # URL path → content
        self.etags: dict[str, str] = {}  # URL path → the ETag reported instead of the content's sha256
        self.requests: list[tuple[str, str]] = []  # (method, path) in arrival order
        self.stall_after: int | None = None
        self.resume = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def add(self, repo: str, filename: str, content: bytes, revision: str = "main", etag: str | None = None) -> None:
        """Serve `content`; `etag` reports another digest than its sha256 (a git file's 40-hex sha1, say)."""
        for rev in (revision, COMMIT):
            self.files[f"/{repo}/resolve/{rev}/{filename}"] = content
            if etag is not None:
                self.etags[f"/{repo}/resolve/{rev}/{filename}"] = etag

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.resume.set()
        self._server.shutdown()
        self._server.server_close()


def _handler_for(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self._respond(send_body=False)

        def do_GET(self):
            self._respond(send_body=True)

        def _respond(self, send_body: bool) -> None:
            path = self.path.split("?", 1)[0]
            hub.requests.append((self.command, path))
            content = hub.files.get(path)
            if content is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hub.etags.get(path) or hashlib.sha256(content).hexdigest()}"')
            self.send_header("Content-Length", str(len(content)))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if send_body:
                self._send(content)

        def _send(self, content: bytes) -> None:
            try:
                for start in range(0, len(content), _CHUNK):
                    if hub.stall_after is not None and start >= hub.stall_after:
                        hub.resume.wait(timeout=60)
                    self.wfile.write(content[start : start + _CHUNK])
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away (a test killed it mid-download)

        def log_message(self, *args) -> None:
            pass

    return Handler
