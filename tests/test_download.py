"""The download stage against a real HTTP server on 127.0.0.1 that drops, stalls and fails on request.

Every case ends in either the verified archive under its final name or a clear error, with nothing
half-written left under the final name.
"""

from __future__ import annotations

import hashlib
import logging
import random
import socket
from pathlib import Path

import pytest

from cifar.config import OFFICIAL_BINARY_URL, OFFICIAL_PYTHON_MD5, OFFICIAL_PYTHON_URL
from cifar.data.download import ArchiveInfo, ChecksumMismatchError, DownloadError, expected_checksums, fetch_archive
from tests.http_server import FaultyHTTPServer

NAME = "cifar-10-python.tar.gz"
PAYLOAD_BYTES = 300_000
FAST = {"backoff_seconds": 0.01, "timeout_seconds": 5.0}  # Tiny backoff keeps retry tests fast.


@pytest.fixture(scope="module")
def payload() -> bytes:
    """A few hundred KB of fixed random bytes standing in for the archive."""
    return random.Random(0).randbytes(PAYLOAD_BYTES)


@pytest.fixture(scope="module")
def digests(payload: bytes) -> dict[str, str]:
    return {"sha256": hashlib.sha256(payload).hexdigest(), "md5": hashlib.md5(payload).hexdigest()}


@pytest.fixture
def server(payload: bytes):
    with FaultyHTTPServer() as running:
        running.add_file(NAME, payload)
        yield running


@pytest.fixture
def downloads(tmp_path: Path) -> Path:
    return tmp_path / "downloads"


def assert_verified(info: ArchiveInfo, downloads: Path, payload: bytes, digests: dict[str, str]) -> None:
    """The archive sits under its final name with the right bytes, and no .part is left."""
    final = downloads.resolve() / NAME
    assert info.path == str(final)
    assert final.read_bytes() == payload
    assert (info.sha256, info.md5) == (digests["sha256"], digests["md5"])
    assert sorted(path.name for path in downloads.iterdir()) == [NAME]


def assert_nothing_written(downloads: Path) -> None:
    """Neither a final file nor a .part exists."""
    assert not downloads.exists() or list(downloads.iterdir()) == []


# Downloads over HTTP.


def record_progress(calls: list[tuple[int, int | None]]):
    """A progress callback that appends each (done, total) call to `calls`."""
    return lambda done, total: calls.append((done, total))


def test_download_verifies_and_reports_progress(server, downloads, payload, digests):
    calls: list[tuple[int, int | None]] = []
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], progress=record_progress(calls), **FAST)
    assert_verified(info, downloads, payload, digests)
    assert info.source == server.url(NAME)
    assert calls[-1] == (PAYLOAD_BYTES, PAYLOAD_BYTES)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert len(server.requests) == 1 and server.requests[0].range is None


def test_download_without_callback_logs_progress(server, downloads, payload, digests, caplog):
    caplog.set_level(logging.INFO, logger="cifar.data.download")
    fetch_archive(server.url(NAME), downloads, md5=digests["md5"], **FAST)
    progress_lines = [record.getMessage() for record in caplog.records if "Downloading" in record.getMessage()]
    assert progress_lines and progress_lines[-1].endswith("(100%)")
    # At most one line per 5% of the archive (plus the final one), however small the chunks are.
    assert len(progress_lines) <= 21


@pytest.mark.parametrize("status", [500, 503, 429, 408])
def test_transient_errors_are_retried(server, downloads, payload, digests, status):
    server.fail_next(status, times=3)
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], retries=5, **FAST)
    assert_verified(info, downloads, payload, digests)
    assert len(server.requests) == 4


def test_retry_after_header_is_accepted(server, downloads, payload, digests):
    server.fail_next(429, headers={"Retry-After": "0"})
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], **FAST)
    assert_verified(info, downloads, payload, digests)


def test_retries_exhausted_raise_download_error(server, downloads, digests):
    server.fail_next(500, times=10)
    with pytest.raises(DownloadError, match=r"after 3 attempts.*HTTP 500"):
        fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], retries=2, **FAST)
    assert len(server.requests) == 3
    assert_nothing_written(downloads)


def test_refused_connection_is_retried_then_fails(downloads, digests):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # Closed again below: nothing listens there.
    with pytest.raises(DownloadError, match="after 2 attempts"):
        fetch_archive(f"http://127.0.0.1:{port}/{NAME}", downloads, sha256=digests["sha256"], retries=1, **FAST)
    assert_nothing_written(downloads)


def test_not_found_fails_at_once(server, downloads, digests):
    with pytest.raises(DownloadError, match="HTTP 404"):
        fetch_archive(server.url("missing.tar.gz"), downloads, sha256=digests["sha256"], retries=5, **FAST)
    assert len(server.requests) == 1
    assert_nothing_written(downloads)


def test_a_host_that_does_not_resolve_fails_at_once(downloads, digests, caplog):
    # `.invalid` never resolves (RFC 2606), online or not: no request leaves this machine.
    url = f"http://cifar-mirror.invalid/{NAME}"
    with caplog.at_level(logging.WARNING), pytest.raises(DownloadError, match="host 'cifar-mirror.invalid' not found"):
        fetch_archive(url, downloads, sha256=digests["sha256"], retries=5, backoff_seconds=60)
    assert not [record for record in caplog.records if "retry" in record.getMessage()]  # No retry was waited for.
    assert_nothing_written(downloads)


def test_forbidden_fails_at_once(server, downloads, digests):
    server.fail_next(403)
    with pytest.raises(DownloadError, match="HTTP 403"):
        fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], retries=5, **FAST)
    assert len(server.requests) == 1


def test_dropped_connection_resumes_with_range(server, downloads, payload, digests):
    half = PAYLOAD_BYTES // 2
    server.drop_next(after_bytes=half)
    calls: list[tuple[int, int | None]] = []
    info = fetch_archive(server.url(NAME), downloads, md5=digests["md5"], progress=record_progress(calls), **FAST)
    assert_verified(info, downloads, payload, digests)
    assert [request.range for request in server.requests] == [None, f"bytes={half}-"]
    assert calls[-1] == (PAYLOAD_BYTES, PAYLOAD_BYTES)


def test_repeated_drops_resume_from_each_new_offset(server, downloads, payload, digests):
    server.drop_next(after_bytes=100_000)
    server.drop_next(after_bytes=100_000)
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], **FAST)
    assert_verified(info, downloads, payload, digests)
    assert [request.range for request in server.requests] == [None, "bytes=100000-", "bytes=200000-"]


def test_stalled_connection_times_out_and_resumes(server, downloads, payload, digests):
    server.stall_next(after_bytes=100_000, seconds=2.0)
    info = fetch_archive(
        server.url(NAME), downloads, sha256=digests["sha256"], backoff_seconds=0.01, timeout_seconds=0.3
    )
    assert_verified(info, downloads, payload, digests)
    assert [request.range for request in server.requests] == [None, "bytes=100000-"]


def test_server_ignoring_range_restarts_from_zero(server, downloads, payload, digests):
    server.ignore_range = True
    server.drop_next(after_bytes=PAYLOAD_BYTES // 2)
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], **FAST)
    assert_verified(info, downloads, payload, digests)
    # The client asked to resume; the 200 with the full body replaced the .part instead of extending it.
    assert server.requests[1].range == f"bytes={PAYLOAD_BYTES // 2}-"


def test_wrong_content_range_restarts_from_zero(server, downloads, payload, digests):
    server.drop_next(after_bytes=1000)
    server.misrange_next()
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], **FAST)
    assert_verified(info, downloads, payload, digests)
    assert [request.range for request in server.requests] == [None, "bytes=1000-", None]


def test_wrong_bytes_raise_checksum_mismatch_and_leave_nothing(server, downloads, payload):
    expected = hashlib.sha256(b"the archive we wanted").hexdigest()
    with pytest.raises(ChecksumMismatchError) as caught:
        fetch_archive(server.url(NAME), downloads, sha256=expected, **FAST)
    message = str(caught.value)
    assert "sha256" in message and expected in message and hashlib.sha256(payload).hexdigest() in message
    assert isinstance(caught.value, ValueError)
    assert_nothing_written(downloads)


def test_md5_mismatch_names_md5(server, downloads, payload):
    expected, actual = "0" * 32, hashlib.md5(payload).hexdigest()
    with pytest.raises(ChecksumMismatchError, match=f"md5 mismatch.*expected {expected}, got {actual}"):
        fetch_archive(server.url(NAME), downloads, md5=expected, **FAST)
    assert_nothing_written(downloads)


def test_mirror_without_checksum_is_refused_before_any_request(server, downloads):
    with pytest.raises(ValueError, match="checksum"):
        fetch_archive(server.url(NAME), downloads, **FAST)
    assert server.requests == []
    assert_nothing_written(downloads)


def test_official_urls_default_to_official_md5():
    assert expected_checksums(OFFICIAL_PYTHON_URL) == {"md5": OFFICIAL_PYTHON_MD5}
    assert expected_checksums(OFFICIAL_BINARY_URL) == {"md5": "c32a1d4ab5d03f1284b67883e8d87530"}
    # A caller's checksum takes precedence over the official one.
    assert expected_checksums(OFFICIAL_PYTHON_URL, sha256="a" * 64) == {"sha256": "a" * 64}


BAD_ARGUMENTS = [{"sha256": "xyz"}, {"md5": "a" * 64}, {"retries": -1}, {"timeout_seconds": 0}, {"backoff_seconds": -1}]


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS)
def test_bad_arguments_raise_value_error(server, downloads, digests, arguments):
    values = {"md5": digests["md5"], **arguments}
    with pytest.raises(ValueError):
        fetch_archive(server.url(NAME), downloads, **values)
    assert server.requests == []


@pytest.mark.parametrize("source", ["ftp://example.org/cifar.tar.gz", "http://127.0.0.1:1/", ""])
def test_unusable_sources_raise_value_error(downloads, source):
    with pytest.raises(ValueError):
        fetch_archive(source, downloads, md5="0" * 32)


# Reuse of earlier results.


def test_existing_verified_archive_is_reused_without_network(server, downloads, payload, digests):
    downloads.mkdir()
    (downloads / NAME).write_bytes(payload)
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], **FAST)
    assert_verified(info, downloads, payload, digests)
    assert server.requests == []


def test_existing_wrong_archive_is_replaced_by_a_verified_download(server, downloads, payload, digests):
    downloads.mkdir()
    (downloads / NAME).write_bytes(b"an older, different archive")
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], **FAST)
    assert_verified(info, downloads, payload, digests)
    assert len(server.requests) == 1


def test_existing_archive_is_left_alone_when_the_download_fails(server, downloads):
    downloads.mkdir()
    (downloads / NAME).write_bytes(b"an older, different archive")
    with pytest.raises(ChecksumMismatchError):
        fetch_archive(server.url(NAME), downloads, md5="0" * 32, **FAST)
    assert (downloads / NAME).read_bytes() == b"an older, different archive"
    assert sorted(path.name for path in downloads.iterdir()) == [NAME]


def test_part_left_by_a_failed_call_is_resumed_by_the_next(server, downloads, payload, digests):
    server.drop_next(after_bytes=120_000)
    with pytest.raises(DownloadError):
        fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], retries=0, **FAST)
    # The interrupted transfer keeps its .part (never the final name) so the next call can resume it.
    assert [path.name for path in downloads.iterdir()] == [NAME + ".part"]
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], retries=0, **FAST)
    assert_verified(info, downloads, payload, digests)
    assert server.requests[-1].range == "bytes=120000-"


def test_stale_part_of_another_file_is_discarded_and_downloaded_again(server, downloads, payload, digests):
    downloads.mkdir()
    (downloads / (NAME + ".part")).write_bytes(b"bytes of some other file")
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], **FAST)
    assert_verified(info, downloads, payload, digests)
    assert [request.range for request in server.requests] == ["bytes=24-", None]


def test_part_longer_than_the_file_restarts_from_zero(server, downloads, payload, digests):
    downloads.mkdir()
    (downloads / (NAME + ".part")).write_bytes(payload + b"trailing garbage")
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], **FAST)
    assert_verified(info, downloads, payload, digests)
    assert [request.range for request in server.requests] == [f"bytes={len(payload) + 16}-", None]


def test_complete_part_is_verified_without_downloading_again(server, downloads, payload, digests):
    downloads.mkdir()
    (downloads / (NAME + ".part")).write_bytes(payload)
    info = fetch_archive(server.url(NAME), downloads, sha256=digests["sha256"], **FAST)
    assert_verified(info, downloads, payload, digests)
    # The server answered 416 "bytes */size": the .part already held the whole file.
    assert [request.range for request in server.requests] == [f"bytes={PAYLOAD_BYTES}-"]


# Local sources.


@pytest.fixture
def local_archive(tmp_path: Path, payload: bytes) -> Path:
    path = tmp_path / "mine" / "archive.tar.gz"
    path.parent.mkdir()
    path.write_bytes(payload)
    return path


def assert_local(info: ArchiveInfo, local_archive: Path, downloads: Path, digests: dict[str, str]) -> None:
    """Verified in place: the result points at the user's file and nothing was copied."""
    assert info.path == str(local_archive.resolve())
    assert (info.sha256, info.md5) == (digests["sha256"], digests["md5"])
    assert_nothing_written(downloads)


def test_local_path_is_verified_in_place(local_archive, downloads, digests):
    info = fetch_archive(str(local_archive), downloads, sha256=digests["sha256"])
    assert_local(info, local_archive, downloads, digests)
    assert info.source == str(local_archive)


def test_relative_and_home_paths_are_resolved(local_archive, downloads, digests, monkeypatch):
    monkeypatch.chdir(local_archive.parent.parent)
    assert_local(fetch_archive("mine/archive.tar.gz", downloads, md5=digests["md5"]), local_archive, downloads, digests)
    monkeypatch.setenv("HOME", str(local_archive.parent))
    assert_local(fetch_archive("~/archive.tar.gz", downloads, md5=digests["md5"]), local_archive, downloads, digests)


def test_file_url_is_verified_in_place(local_archive, downloads, digests):
    info = fetch_archive(local_archive.as_uri(), downloads, sha256=digests["sha256"], md5=digests["md5"])
    assert_local(info, local_archive, downloads, digests)


def test_local_file_without_checksum_is_accepted_with_a_warning(local_archive, downloads, digests, caplog):
    caplog.set_level(logging.WARNING, logger="cifar.data.download")
    info = fetch_archive(str(local_archive), downloads)
    assert_local(info, local_archive, downloads, digests)
    assert any("No checksum" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("as_url", [False, True])
def test_local_mismatch_names_both_digests_and_leaves_the_file(local_archive, downloads, payload, digests, as_url):
    expected = "f" * 64
    source = local_archive.as_uri() if as_url else str(local_archive)
    message = f"sha256 mismatch.*expected {expected}, got {digests['sha256']}"
    with pytest.raises(ChecksumMismatchError, match=message):
        fetch_archive(source, downloads, sha256=expected)
    assert local_archive.read_bytes() == payload
    assert_nothing_written(downloads)


@pytest.mark.parametrize("as_url", [False, True])
def test_missing_local_file_raises_file_not_found(tmp_path, downloads, as_url):
    missing = tmp_path / "nowhere.tar.gz"
    with pytest.raises(FileNotFoundError, match="nowhere.tar.gz"):
        fetch_archive(missing.as_uri() if as_url else str(missing), downloads, md5="0" * 32)
    assert_nothing_written(downloads)


def test_archive_info_serialises_to_json(local_archive, downloads, digests):
    info = fetch_archive(str(local_archive), downloads, sha256=digests["sha256"])
    assert ArchiveInfo.model_validate_json(info.model_dump_json()) == info
