"""Service.post's retries: which failures are retried, the pauses between attempts, one warning per retry, and the
final one-line error, against a stdlib HTTP server in a thread (no reward to load, no real pause)."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time

import pytest

from grpo.errors import DependencyDown
from grpo.rewards.client import Service, ServiceDown, ServiceError
from tools.launch import free_port

SETTING = "rewards.remote"


class _Answers(http.server.BaseHTTPRequestHandler):
    """POST /<status>/<status>...: the n-th request gets the n-th status (the last one repeats); `slow` answers after
    0.3 s."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        statuses = self.path.strip("/").split("/")
        status = statuses[min(self.server.posts, len(statuses) - 1)]
        self.server.posts += 1
        if status == "slow":
            threading.Event().wait(0.3)  # not time.sleep: the test records those
            status = "200"
        body = json.dumps({"error": f"answer {status}\ntraceback"} if status != "200" else {"scores": []}).encode()
        try:
            self.send_response(int(status))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up waiting

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def pauses(monkeypatch) -> list[float]:
    paused: list[float] = []
    monkeypatch.setattr(time, "sleep", paused.append)
    return paused


def _service(url: str, retries: int = 3, timeout: float = 5.0) -> Service:
    return Service({"url": url, "timeout": timeout, "retries": retries, "backoff": 1.0}, SETTING)


DOWN = "; the server stopped answering: restart it (or wait for it), then rerun with checkpoint.resume=auto"


@pytest.mark.parametrize("path, down, attempts, last", [
    ("/503", True, 4, "HTTP 503: answer 503"),
    ("/429", True, 4, "HTTP 429: answer 429"),
    ("/502", True, 4, "HTTP 502: answer 502"),
    ("/500", False, 4, "HTTP 500: answer 500"),
    ("/400", False, 1, "HTTP 400: answer 400"),
    ("/404", False, 1, "HTTP 404: answer 404"),
    ("/503/400", False, 2, "HTTP 400: answer 400"),  # the last answer decides
    ("/500/503", True, 4, "HTTP 503: answer 503"),
])
def test_answers_retried_or_not(server, pauses, caplog, path, down, attempts, last) -> None:
    server.posts = 0
    url = f"http://127.0.0.1:{server.server_port}"
    with caplog.at_level(logging.WARNING), pytest.raises(ServiceError) as err:
        _service(url).post(path, data=b"x")
    failure = f"{SETTING}: {url}{path} failed after {attempts} attempt{'s' if attempts > 1 else ''}: {last}"
    assert str(err.value) == failure + (DOWN if down else "")
    assert isinstance(err.value, ServiceDown) is down and isinstance(err.value, DependencyDown) is down
    assert server.posts == attempts
    assert pauses == [1.0, 2.0, 4.0][:attempts - 1]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == attempts - 1 and all(r.name == "grpo.rewards.client" for r in caplog.records), lines
    statuses = path.strip("/").split("/")
    for n, line in enumerate(lines):
        status = statuses[min(n, len(statuses) - 1)]
        assert line == (f"{SETTING}: {url}{path} failed (HTTP {status}: answer {status}); retry {n + 1}/3 in "
                        f"{2.0 ** n:.1f} s")


def test_a_retried_answer_then_success(server, pauses, caplog) -> None:
    server.posts = 0
    url = f"http://127.0.0.1:{server.server_port}"
    with caplog.at_level(logging.WARNING):
        response = _service(url).post("/503/429/200", json={"a": 1})
    assert response.status_code == 200 and response.json() == {"scores": []}
    assert server.posts == 3 and pauses == [1.0, 2.0] and len(caplog.records) == 2


def test_no_connection_and_no_answer_in_time(server, pauses, caplog) -> None:
    refused = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING), pytest.raises(ServiceDown) as err:
        _service(refused).post("/score", data=b"x")
    assert str(err.value) == f"{SETTING}: {refused}/score failed after 4 attempts: ConnectionError" + DOWN
    assert pauses == [1.0, 2.0, 4.0]
    # one line per retry: urllib3's own "Retrying ..." warning is not logged as well
    assert [r.getMessage() for r in caplog.records] == [
        f"{SETTING}: {refused}/score failed (ConnectionError); retry {n}/3 in {2.0 ** (n - 1):.1f} s"
        for n in (1, 2, 3)]

    server.posts = 0
    pauses.clear()
    caplog.clear()
    url = f"http://127.0.0.1:{server.server_port}"
    with caplog.at_level(logging.WARNING), pytest.raises(ServiceDown) as err:
        _service(url, retries=2, timeout=0.05).post("/slow", data=b"x")
    assert str(err.value) == (f"{SETTING}: {url}/slow failed after 3 attempts: no answer within timeout 0.05 s"
                              + DOWN)
    assert server.posts == 3 and pauses == [1.0, 2.0]
    assert [r.getMessage() for r in caplog.records] == [
        f"{SETTING}: {url}/slow failed (no answer within timeout 0.05 s); retry {n}/2 in {2.0 ** (n - 1):.1f} s"
        for n in (1, 2)]


def test_no_retries(server, pauses) -> None:
    server.posts = 0
    url = f"http://127.0.0.1:{server.server_port}"
    with pytest.raises(ServiceDown, match=r"failed after 1 attempt: HTTP 503: answer 503;"):
        _service(url, retries=0).post("/503", data=b"x")
    assert server.posts == 1 and pauses == []
