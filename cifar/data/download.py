"""The download stage: fetch the CIFAR-10 archive (or find it locally) and verify its checksums.

Sources are an http(s) URL, a `file://` URL or a local path (`~` expanded; verified in place, never
copied). A download streams into `downloads_dir/<name>.part`, retried and resumed on transient faults,
and takes its final name only once verified (docs/RELIABILITY.md, "Download faults").
"""

from __future__ import annotations

import email.utils
import http.client
import logging
import os
import random
import re
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from cifar.config import OFFICIAL_MD5_BY_URL
from cifar.io import file_digests, normalise_digest
from cifar.results import ArchiveInfo

logger = logging.getLogger("cifar.data.download")

ProgressCallback = Callable[[int, int | None], None]

READ_CHUNK_BYTES = 64 * 1024  # Largest piece read from the socket at once.
MAX_BACKOFF_SECONDS = 60.0  # Cap on one wait between retries, Retry-After included.
LOG_EVERY_FRACTION = 0.05  # Log progress at most every 5% of the archive...
LOG_EVERY_SECONDS = 5.0  # ...or every 5 seconds, whichever comes first.
CALLBACK_EVERY_FRACTION = 0.01  # The progress callback sees at most ~100 updates plus the final one.
CALLBACK_EVERY_BYTES_UNKNOWN_TOTAL = 1 << 20  # Without a Content-Length, one update per MiB.
RETRYABLE_STATUSES = frozenset({408, 429})  # Plus every 5xx.
USER_AGENT = "cifar-pipeline/0.1 (+urllib)"
# Failures of the connection rather than of the local disk; HTTPError (a URLError) is handled first.
NETWORK_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, ssl.SSLError)


class ChecksumMismatchError(ValueError):
    """The archive's digest differs from the expected one."""

    def __init__(self, algorithm: str, source: str, expected: str, actual: str) -> None:
        super().__init__(
            f"{algorithm} mismatch for {source}: expected {expected}, got {actual} "
            "(a corrupted download, a different file, or a wrong checksum in the configuration)"
        )
        self.algorithm = algorithm
        self.source = source
        self.expected = expected
        self.actual = actual


class DownloadError(RuntimeError):
    """The archive could not be downloaded (a permanent HTTP error, or retries exhausted)."""


class _RetryableError(Exception):
    """A transient failure worth retrying; `retry_after` is the server's requested wait, if any."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def fetch_archive(
    source: str,
    downloads_dir: str | Path,
    *,
    sha256: str | None = None,
    md5: str | None = None,
    retries: int = 5,
    progress: ProgressCallback | None = None,
    backoff_seconds: float = 1.0,
    timeout_seconds: float = 60.0,
) -> ArchiveInfo:
    """Returns the verified archive for `source`, downloading it into `downloads_dir` if it is remote."""
    source = os.fspath(source).strip()
    if not source:
        raise ValueError("source is empty: pass an http(s) URL, a file:// URL or a local path")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    if backoff_seconds < 0:
        raise ValueError(f"backoff_seconds must be >= 0, got {backoff_seconds}")
    if timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
    given = (("sha256", sha256), ("md5", md5))
    expected = {algorithm: normalise_digest(algorithm, digest) for algorithm, digest in given if digest is not None}

    scheme = urllib.parse.urlsplit(source).scheme.lower()
    # A one-letter "scheme" is a Windows drive letter, not a URL.
    if scheme in {"", "file"} or len(scheme) == 1:
        return _verify_local(source, expected)
    if scheme not in {"http", "https"}:
        raise ValueError(f"unsupported source {source!r}: expected an http(s) URL, a file:// URL or a local path")
    expected = expected_checksums(source, **expected)
    final = Path(downloads_dir).expanduser().resolve() / _file_name(source)
    digests = _reusable_digests(final, source, expected)
    if digests is None:
        final.parent.mkdir(parents=True, exist_ok=True)
        part = final.with_name(final.name + ".part")
        transfer = _Transfer(source, part, _ProgressReporter(source, progress), timeout_seconds)
        digests = _download_and_verify(transfer, expected, retries, backoff_seconds)
        os.replace(part, final)  # Atomic: the final name only ever holds a verified archive.
        logger.info("Downloaded and verified %s -> %s", source, final)
    return ArchiveInfo(path=str(final), source=source, **digests)


def expected_checksums(url: str, sha256: str | None = None, md5: str | None = None) -> dict[str, str]:
    """The digests an http(s) download must match: the caller's, else the official MD5 of an official URL."""
    given = {algorithm: digest for algorithm, digest in (("sha256", sha256), ("md5", md5)) if digest}
    if given:
        return given
    if url in OFFICIAL_MD5_BY_URL:
        return {"md5": OFFICIAL_MD5_BY_URL[url]}
    raise ValueError(
        f"no checksum for {url}: a download from a mirror must be verified, so pass its sha256 or md5 "
        "(data.sha256 / data.md5 in the configuration)"
    )


def _verify(path: Path, source: str, expected: dict[str, str]) -> dict[str, str]:
    """Hashes `path` once and raises ChecksumMismatchError unless every expected digest matches."""
    actual = file_digests(path)
    for algorithm, digest in expected.items():
        if actual[algorithm] != digest:
            raise ChecksumMismatchError(algorithm, source, expected=digest, actual=actual[algorithm])
    return actual


# Local sources.


def _local_path(source: str) -> Path:
    """The absolute path named by a local path or a file:// URL."""
    parts = urllib.parse.urlsplit(source)
    if parts.scheme.lower() == "file":
        if parts.netloc not in {"", "localhost"}:
            raise ValueError(f"file:// URL {source!r} names host {parts.netloc!r}: only local files are supported")
        return Path(urllib.request.url2pathname(parts.path)).resolve()
    return Path(source).expanduser().resolve()


def _verify_local(source: str, expected: dict[str, str]) -> ArchiveInfo:
    """Verifies a local archive in place (no copy)."""
    path = _local_path(source)
    if not path.is_file():
        raise FileNotFoundError(f"archive {source!r} not found: {path} is not a file")
    info = ArchiveInfo(path=str(path), source=source, **_verify(path, source, expected))
    if not expected:
        message = "No checksum given for local archive %s: accepting it unverified (sha256 %s, md5 %s)"
        logger.warning(message, path, info.sha256, info.md5)
    return info


# Remote sources.


def _file_name(url: str) -> str:
    """The last path segment of the URL: the archive's name in downloads_dir."""
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if name in {"", ".", ".."} or "/" in name or "\\" in name:
        raise ValueError(f"cannot derive a file name from {url!r}: the URL path must end in the archive's name")
    return name


def _reusable_digests(final: Path, url: str, expected: dict[str, str]) -> dict[str, str] | None:
    """The digests of an existing final file that matches, else None (a mismatching one is left in place)."""
    if not final.is_file():
        return None
    try:
        digests = _verify(final, url, expected)
    except ChecksumMismatchError as error:
        logger.warning("Existing %s does not match (%s); downloading a fresh copy", final, error)
        return None
    logger.info("Reusing verified archive %s", final)
    return digests


def _download_and_verify(
    transfer: _Transfer, expected: dict[str, str], retries: int, backoff_seconds: float
) -> dict[str, str]:
    """Completes and verifies the .part, deleting it on a mismatch; a resumed one that fails gets one fresh try.

    A transfer that runs out of retries (or is interrupted, by Ctrl-C say) keeps its .part on purpose:
    the next call resumes it instead of starting over.
    """
    # Bytes kept from an earlier call may belong to another file: worth one try from zero.
    resumed = transfer.part.is_file() and transfer.part.stat().st_size > 0
    while True:
        _with_retries(transfer.run, transfer.url, retries, backoff_seconds)
        try:
            return _verify(transfer.part, transfer.url, expected)
        except ChecksumMismatchError as error:
            transfer.part.unlink(missing_ok=True)
            if not resumed:
                raise
            resumed = False
            logger.warning("Resumed download failed verification (%s); downloading again from zero", error)


def _with_retries(action: Callable[[], None], url: str, retries: int, backoff_seconds: float) -> None:
    """Runs `action`, retrying transient failures with exponential backoff and jitter."""
    for attempt in range(retries + 1):
        try:
            action()
            return
        except _RetryableError as error:
            if attempt == retries:
                attempts = f"{retries + 1} attempt" + ("s" if retries else "")
                raise DownloadError(f"download of {url} failed after {attempts}: {error}") from error
            delay = _backoff_delay(attempt, backoff_seconds, error.retry_after)
            logger.warning(
                "Download of %s failed (%s); retry %d of %d in %.1f s", url, error, attempt + 1, retries, delay
            )
            time.sleep(delay)


def _backoff_delay(attempt: int, backoff_seconds: float, retry_after: float | None) -> float:
    """Exponential backoff with jitter (50-100% of the step), at least the server's Retry-After, capped."""
    step = min(backoff_seconds * 2**attempt, MAX_BACKOFF_SECONDS)
    delay = step * random.uniform(0.5, 1.0)  # Jitter keeps many clients from retrying in lockstep.
    return min(max(delay, retry_after or 0.0), MAX_BACKOFF_SECONDS)


def _retry_after_seconds(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date), if present."""
    if not value:
        return None
    if value.strip().isdigit():
        return float(value.strip())
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)", re.IGNORECASE)
_UNSATISFIED_RANGE = re.compile(r"bytes\s+\*/(\d+)", re.IGNORECASE)


class _Transfer:
    """One URL streamed into its .part file; each `run()` is one HTTP request resuming where it stopped."""

    def __init__(self, url: str, part: Path, reporter: _ProgressReporter, timeout_seconds: float) -> None:
        self.url = url
        self.part = part
        self.reporter = reporter
        self.timeout_seconds = timeout_seconds

    def run(self) -> None:
        """Sends one request and appends the body to the .part; raises _RetryableError on transient faults."""
        offset = self.part.stat().st_size if self.part.is_file() else 0
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"  # Resume where the .part ends.
        try:
            request = urllib.request.Request(self.url, headers=headers)
            with urllib.request.urlopen(request, timeout=self.timeout_seconds) as response:
                offset, total = self._start_offset(response, offset)
                self._stream(response, offset, total)
        except urllib.error.HTTPError as error:
            self._handle_http_error(error, offset)
        except NETWORK_ERRORS as error:
            reason = getattr(error, "reason", None) or error
            if isinstance(reason, ssl.SSLCertVerificationError):
                # An untrusted certificate will not fix itself by retrying.
                raise DownloadError(f"download of {self.url} failed: {reason}") from error
            if isinstance(reason, socket.gaierror):
                # Neither will a host name that does not resolve (a typo, or no network at all).
                raise DownloadError(
                    f"download of {self.url} failed: host {urllib.parse.urlsplit(self.url).hostname!r} "
                    f"not found ({reason.strerror}); check the URL and the network, or pass a "
                    "local copy as the source"
                ) from error
            # Connection refused or reset, timeout, truncated body: all worth a retry.
            # Local file errors (a full disk) are plain OSErrors and propagate unchanged.
            raise _RetryableError(f"{type(error).__name__}: {reason}") from error

    def _start_offset(self, response: http.client.HTTPResponse, offset: int) -> tuple[int, int | None]:
        """Where the body starts in the file and the file's total size, truncating the .part if needed."""
        if response.status == 206:
            match = _CONTENT_RANGE.fullmatch((response.headers.get("Content-Range") or "").strip())
            if match is None or int(match.group(1)) != offset:
                self.part.unlink(missing_ok=True)
                raise _RetryableError(
                    f"server answered Range bytes={offset}- with Content-Range "
                    f"{response.headers.get('Content-Range')!r}; restarting from zero"
                )
            total = None if match.group(3) == "*" else int(match.group(3))
            return offset, total
        if offset:
            logger.info("Server ignored the Range request for %s; restarting from zero", self.url)
        self.part.write_bytes(b"")  # A 200 carries the whole file: drop what the .part held.
        length = response.headers.get("Content-Length")
        return 0, int(length) if length and length.isdigit() else None

    def _stream(self, response: http.client.HTTPResponse, offset: int, total: int | None) -> None:
        """Appends the response body to the .part in chunks, reporting progress."""
        done = offset
        with open(self.part, "ab") as handle:
            # read1 returns what has arrived, so a timeout never discards bytes already received.
            while chunk := response.read1(READ_CHUNK_BYTES):
                handle.write(chunk)
                done += len(chunk)
                self.reporter.update(done, total)
            handle.flush()
            os.fsync(handle.fileno())
        if total is not None and done < total:
            raise _RetryableError(f"connection closed after {done} of {total} bytes")
        if total is not None and done > total:
            self.part.unlink(missing_ok=True)
            raise _RetryableError(f"received {done} bytes but the server announced {total}; restarting from zero")
        self.reporter.finish(done)

    def _handle_http_error(self, error: urllib.error.HTTPError, offset: int) -> None:
        """Turns an HTTP error status into a retry, a restart, a finished transfer or a DownloadError."""
        status = error.code
        if status == 416 and offset:
            match = _UNSATISFIED_RANGE.fullmatch((error.headers.get("Content-Range") or "").strip())
            if match is not None and int(match.group(1)) == offset:
                self.reporter.finish(offset)  # The .part already holds the whole file.
                return
            self.part.unlink(missing_ok=True)
            raise _RetryableError(f"HTTP 416 for Range bytes={offset}-; restarting from zero") from error
        if status >= 500 or status in RETRYABLE_STATUSES:
            retry_after = _retry_after_seconds(error.headers.get("Retry-After"))
            raise _RetryableError(f"HTTP {status} {error.reason}", retry_after=retry_after) from error
        raise DownloadError(f"download of {self.url} failed: HTTP {status} {error.reason}") from error


class _ProgressReporter:
    """Forwards byte counts to the caller's callback (throttled), or logs them when there is none."""

    def __init__(self, url: str, callback: ProgressCallback | None) -> None:
        self.url = url
        self.callback = callback
        self.last_bytes = -1
        self.last_log_time = time.monotonic()

    def update(self, done: int, total: int | None) -> None:
        """Reports `done` bytes of `total` when enough has changed since the last report."""
        if self.callback is not None:
            step = total * CALLBACK_EVERY_FRACTION if total else CALLBACK_EVERY_BYTES_UNKNOWN_TOTAL
            due = False
        else:
            step = total * LOG_EVERY_FRACTION if total else float("inf")
            due = time.monotonic() - self.last_log_time >= LOG_EVERY_SECONDS
        if due or abs(done - self.last_bytes) >= step or done == total:
            self._emit(done, total)

    def finish(self, done: int) -> None:
        """Reports completion: the total is now known to be `done`."""
        if done != self.last_bytes:
            self._emit(done, done)

    def _emit(self, done: int, total: int | None) -> None:
        self.last_bytes = done
        self.last_log_time = time.monotonic()
        if self.callback is not None:
            self.callback(done, total)
        elif total:
            percent = 100 * done / total
            logger.info("Downloading %s: %.1f of %.1f MB (%.0f%%)", self.url, done / 1e6, total / 1e6, percent)
        else:
            logger.info("Downloading %s: %.1f MB", self.url, done / 1e6)
