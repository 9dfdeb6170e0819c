"""A local stand-in for the Hugging Face Hub's file API, so that download tests
run the real `huggingface_hub` client code without reaching the network.

`hf_hub_download(repo_id, filename, local_dir=...)` makes two requests, both on
`{HF_ENDPOINT}/{repo_id}/resolve/{revision}/{filename}`: HEAD, whose headers
carry the file's metadata (`X-Repo-Commit`, the 40-hex commit the revision
resolves to; `ETag`, a version id of the file; `Content-Length`), and GET,
the same headers plus the bytes. Errors are 404s told apart by `X-Error-Code`:
`RepoNotFound` (-> RepositoryNotFoundError) and `EntryNotFound` (->
RemoteEntryNotFoundError); see huggingface_hub's utils/_http.py
`hf_raise_for_status` and file_download.py `get_hf_file_metadata`. The `hub`
fixture serves a dict {repo_id: {filename: bytes}} and points huggingface_hub
at it; `closed_endpoint()` is a URL where nothing listens (no network).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

# /{repo_id}/resolve/{revision}/{filename}; a repo id may hold one "/" (owner/name).
RESOLVE_PATH = re.compile(r"^/(?P<repo_id>[^/]+(?:/[^/]+)?)/resolve/(?P<revision>[^/]+)/(?P<filename>.+)$")


class HubServer:
    """Serves {repo_id: {filename: bytes}} on 127.0.0.1 at a free port.

    Attributes:
        url: the endpoint to use as HF_ENDPOINT, e.g. "http://127.0.0.1:40123".
        requests: every request received, as (method, path), in order.
        failures: HTTP statuses to answer the next requests with, one each
            (e.g. [503]: one server error, then the files).
    """

    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self.failures: list[int] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and closes the port: later requests are refused."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def files_requested(self, method: str = "GET") -> list[str]:
        """The filenames requested with `method`, in order."""
        names = []
        for m, path in self.requests:
            match = RESOLVE_PATH.match(path)
            if m == method and match:
                names.append(unquote(match["filename"]))
        return names

    @staticmethod
    def commit_of(repo_id: str) -> str:
        """A fixed 40-hex commit id per repo, like a git sha1."""
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.0: one request per connection, so a stopped server leaves
            # no kept-alive connection behind for the client to reuse.
            protocol_version = "HTTP/1.0"

            def do_HEAD(self) -> None:
                self._answer(send_body=False)

            def do_GET(self) -> None:
                self._answer(send_body=True)

            def _answer(self, send_body: bool) -> None:
                with server._lock:
                    server.requests.append((self.command, self.path))
                    failure = server.failures.pop(0) if server.failures else None
                if failure is not None:
                    return self._error(failure, "Failure", f"status {failure}", None, send_body)
                match = RESOLVE_PATH.match(self.path.split("?", 1)[0])
                if match is None:
                    return self._error(404, "RepoNotFound", f"no route for {self.path}", None, send_body)
                repo_id, filename = unquote(match["repo_id"]), unquote(match["filename"])
                if repo_id not in server.repos:
                    return self._error(404, "RepoNotFound", "Repository not found", None, send_body)
                commit = server.commit_of(repo_id)
                files = server.repos[repo_id]
                if filename not in files:
                    return self._error(404, "EntryNotFound", f"{filename} does not exist", commit, send_body)
                body = files[filename]
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

            def _error(self, status: int, code: str, message: str, commit: str | None, send_body: bool) -> None:
                body = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                if commit is not None:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:
                pass  # keep pytest's output clean

        return Handler


@functools.cache
def closed_endpoint() -> str:
    """An http://127.0.0.1:PORT URL where nothing listens: connecting is refused
    at once, like a machine with no network. The port stays bound (never
    listening) while this process lives, so no HubServer of another xdist
    worker can be given it."""
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reserved.bind(("127.0.0.1", 0))
    RESERVED_PORTS.append(reserved)
    return f"http://127.0.0.1:{reserved.getsockname()[1]}"


RESERVED_PORTS: list[socket.socket] = []  # closed_endpoint's socket, kept open


def point_huggingface_hub_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, hf_home: Path) -> None:
    """Makes `huggingface_hub` talk to `endpoint`, with its home, cache and
    token in `hf_home` (the user's own are never read or written).

    huggingface_hub reads these environment variables into
    `huggingface_hub.constants` once, at import, so the constants are patched
    too; the environment variables are set for any subprocess.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(hf_home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(hf_home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    # When the endpoint refuses connections, huggingface_hub retries 5 times
    # with exponential backoff (1 + 2 + 4 + 8 + 8 s) before giving up. The
    # retries still happen; only their sleeps are skipped, to keep tests fast.
    monkeypatch.setattr(_http, "time", _NoSleepTime())


class _NoSleepTime:
    """The `time` module as huggingface_hub's HTTP helper uses it, minus the waiting."""

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[[dict], HubServer]]:
    """A factory: `hub({repo_id: {filename: bytes}})` starts a local Hub that
    serves those files and points huggingface_hub at it. Servers are stopped
    when the test ends."""
    servers: list[HubServer] = []

    def start(repos: dict[str, dict[str, bytes]]) -> HubServer:
        server = HubServer(repos).start()
        servers.append(server)
        point_huggingface_hub_at(monkeypatch, server.url, tmp_path / "hf_home")
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Points huggingface_hub at a closed local port (no network); returns that URL."""
    endpoint = closed_endpoint()
    point_huggingface_hub_at(monkeypatch, endpoint, tmp_path / "hf_home")
    return endpoint
