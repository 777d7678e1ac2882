"""HTTP of the rewards that a server scores (`remote`, `vlm_judge`): their shared options, requests with a timeout and
retries, start-up probes, one-line errors.

A request is retried (urllib3's Retry through a requests HTTPAdapter) after a connection error, a timeout, HTTP 429
or 5xx (a server starting, overloaded or restarting), with pauses of backoff, 2 x backoff, 4 x backoff ... seconds;
any other HTTP error is the caller's mistake and is not retried. When every attempt failed, scoring raises
ServiceError: one line naming the reward, the URL, the attempts and the last error. When the server stopped answering
(no connection, no answer in time, 429, 502-504) it is ServiceDown, a grpo.errors.DependencyDown: the run ends with
that line, the fix, and exit 75 (retry later); its last checkpoint lets `checkpoint.resume=auto` continue once the
server is back. Any other failure (a 4xx, a reward that fails on the server with 500, an answer that is not one) is a
bug to fix, not to wait out: the same one line (a grpo.errors.OutsideFailure, whose traceback goes to
output_dir/logs/) and exit 1.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import NewConnectionError, ProxyError, ReadTimeoutError, SSLError
from urllib3.exceptions import TimeoutError as NoAnswer
from urllib3.util.retry import Retry

from grpo.errors import ConfigError, DependencyDown, OutsideFailure
from grpo.rewards.options import CommonOptions
from grpo.schema import setting

__all__ = ["ServiceOptions", "ServiceError", "ServiceDown", "Service", "answer_error"]

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0  # the start-up check must answer fast: a server that is up replies in milliseconds


@dataclass(kw_only=True)
class ServiceOptions(CommonOptions):
    """Options of every reward scored by a server."""

    url: str = setting(help="base URL of the server, e.g. http://10.0.0.5:8000")
    timeout: float = setting(120.0, help="seconds to wait for one answer before retrying (a batch's scoring)")
    retries: int = setting(3, help="further attempts after a connection error, timeout, HTTP 429 or 5xx")
    backoff: float = setting(1.0, help="seconds before the first retry; doubles for each further one")


class ServiceError(OutsideFailure):
    """A served reward got no usable answer after every attempt (one line; the run ends with it and exit 1, the
    traceback in output_dir/logs/)."""


class ServiceDown(ServiceError, DependencyDown):
    """The server stopped answering: every attempt failed to connect, timed out or was told to come back later."""


# Answers that mean "not now" rather than "not like this": an overloaded server, or a proxy before a server that is
# down or restarting.
_NOT_NOW = (429, 502, 503, 504)
_RETRIED = (429, *range(500, 600))  # any other answer is the request's fault: the same request would fail again


def answer_error(response: requests.Response) -> str:
    """The server's one-line error: a JSON body's `error` (the reward server's) or `error.message` (OpenAI's), else
    the body's first line."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return _error_line(response.status_code, body)


def _error_line(status: int, body: Any) -> str:
    error = body.get("error", body) if isinstance(body, dict) else body
    text = str(error.get("message", error) if isinstance(error, dict) else error)
    lines = text.strip().splitlines()
    return f"HTTP {status}" + (f": {lines[0][:300]}" if lines else "")


def _failure(error: Exception, timeout: float) -> str:
    """A failed attempt's error as the lines name it: the timeout, else the requests exception urllib3's becomes."""
    if isinstance(error, requests.RequestException):
        reason = getattr(error.args[0], "reason", None) if error.args else None
        # a read timeout on the last attempt reaches here as requests' ConnectionError of urllib3's MaxRetryError
        if isinstance(error, requests.Timeout) or isinstance(reason, ReadTimeoutError):
            return f"no answer within timeout {timeout:g} s"
        return type(error).__name__
    if isinstance(error, NoAnswer) and not isinstance(error, NewConnectionError):
        return f"no answer within timeout {timeout:g} s"
    return "SSLError" if isinstance(error, SSLError) else "ProxyError" if isinstance(error, ProxyError) \
        else "ConnectionError"


def _check_url(url: str, setting_name: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{setting_name}.url: {url!r} is not an http(s) URL; e.g. http://10.0.0.5:8000")
    return url.rstrip("/")


class _Retry(Retry):
    """urllib3's Retry for one request of a Service, with this module's pauses and log line.

    Pauses are backoff, 2 x backoff, 4 x backoff ... from the first retry on (urllib3's formula pauses 0 s before the
    first one and caps at 120 s); each retry logs one warning naming the reward, the URL and the error. `failures`,
    one list shared by the copies that urllib3 makes per attempt, holds the retried attempts' errors.
    """

    def __init__(self, *args: Any, service: Service, url: str, failures: list[str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.service, self.url = service, url
        self.failures = [] if failures is None else failures

    def new(self, **kw: Any) -> _Retry:
        return super().new(service=self.service, url=self.url, failures=self.failures, **kw)

    def get_backoff_time(self) -> float:
        return self.backoff_factor * 2 ** (len(self.history) - 1)

    def increment(self, method: str | None = None, url: str | None = None, response: Any = None,
                  error: Exception | None = None, _pool: Any = None, _stacktrace: Any = None) -> _Retry:
        new = super().increment(method, url, response, error, _pool, _stacktrace)  # MaxRetryError after the last
        service = self.service
        if response is not None:  # read only when retrying: the last answer's body is the caller's
            data = response.read(decode_content=True, cache_content=True)
            try:
                body = json.loads(data)
            except ValueError:
                body = data.decode("utf-8", "replace")
            self.failures.append(_error_line(response.status, body))
        else:
            self.failures.append(_failure(error, service.timeout))
        logger.warning("%s: %s failed (%s); retry %d/%d in %.1f s", service.setting, self.url, self.failures[-1],
                       len(self.failures), service.retries, new.get_backoff_time())
        return new


class _OwnLine(logging.Filter):
    """Drops urllib3's "Retrying ..." warning for a _Retry: it logs its own line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.args, tuple) and record.args and isinstance(record.args[0], _Retry))


logging.getLogger("urllib3.connectionpool").addFilter(_OwnLine())


class Service:
    """One server's base URL with the reward's timeout and retry options.

    Args:
        options: validated ServiceOptions (url, timeout, retries, backoff).
        setting_name: "rewards.<name>", the start of every error.
        headers: sent with every request (e.g. an API key).
    """

    def __init__(self, options: dict[str, Any], setting_name: str, headers: dict[str, str] | None = None) -> None:
        self.url = _check_url(options["url"], setting_name)
        self.timeout = options["timeout"]
        self.retries = options["retries"]
        self.backoff = options["backoff"]
        self.setting = setting_name
        self.headers = headers or {}

    @classmethod
    def check(cls, options: dict[str, Any], setting_name: str) -> None:
        """Option values a request needs (raise ConfigError)."""
        _check_url(options["url"], setting_name)
        for key in ("timeout", "backoff"):
            if not options[key] > 0:
                raise ConfigError(f"{setting_name}.{key}: {options[key]}; use a positive number of seconds")
        if options["retries"] < 0:
            raise ConfigError(f"{setting_name}.retries: {options['retries']}; use 0 (no retry) or more")

    def probe(self, path: str, what: str) -> Any:
        """GET `path` once with a short timeout; its JSON, or a ConfigError saying the server is not up."""
        url = self.url + path
        try:
            response = requests.get(url, headers=self.headers, timeout=min(self.timeout, PROBE_TIMEOUT_S))
        except requests.RequestException as err:
            raise ConfigError(f"{self.setting}.url: no answer from {url} ({type(err).__name__}); start {what} "
                              f"there or fix the url") from None
        if response.status_code != 200:
            raise ConfigError(f"{self.setting}.url: {url} answered {answer_error(response)}; is {what} running there?")
        try:
            return response.json()
        except ValueError:
            raise ConfigError(f"{self.setting}.url: {url} did not answer JSON; is {what} running there?") from None

    def post(self, path: str, **kwargs: Any) -> requests.Response:
        """POST with retries (see _Retry); the successful response, or ServiceError after the last attempt."""
        url = self.url + path
        retry = _Retry(total=self.retries, allowed_methods=None, status_forcelist=_RETRIED, backoff_factor=self.backoff,
                       raise_on_status=False, respect_retry_after_header=False, service=self, url=url)
        # A session per request, as requests.post opens one: no kept-alive connection that the server closed since
        # (a retry with no outage), and nothing shared by the judge's threads.
        with requests.Session() as session:
            for scheme in ("http://", "https://"):
                session.mount(scheme, HTTPAdapter(max_retries=retry))
            try:
                response = session.post(url, headers=self.headers, timeout=self.timeout, **kwargs)
            except requests.RequestException as err:
                last, down = _failure(err, self.timeout), True
            else:
                if response.status_code == 200:
                    return response
                last, down = answer_error(response), response.status_code in _NOT_NOW
        attempt = len(retry.failures)
        attempts = f"{attempt + 1} attempt{'s' if attempt else ''}"
        if down:
            raise ServiceDown(f"{self.setting}: {url} failed after {attempts}: {last}; the server stopped answering: "
                              "restart it (or wait for it), then rerun with checkpoint.resume=auto")
        raise ServiceError(f"{self.setting}: {url} failed after {attempts}: {last}")
