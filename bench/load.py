"""A bounded HTTP load from `hey` (Debian's package: `apt-get install hey`), on 127.0.0.1: a fixed duration and
number of concurrent clients, each sending one request after another; throughput, latency percentiles, status
codes, and the CPU seconds `hey` itself took (it shares the cores with the server it measures)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

import common  # bench/ is on sys.path wherever this module is imported (bench/serving.py).


@dataclass(frozen=True)
class Load:
    clients: int
    seconds: float
    requests_per_second: float
    p50_ms: float
    p99_ms: float
    statuses: dict[int, int]
    errors: int
    client_cpu_seconds: float

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)


def require_hey() -> str:
    path = shutil.which("hey")
    if path is None:
        raise SystemExit("this bench drives the load with `hey`: apt-get install hey (Debian's package)")
    return path


def run_hey(url: str, body_path: str, content_type: str, clients: int, seconds: float, auth: str | None = None) -> Load:
    command = [require_hey(), "-z", f"{seconds:g}s", "-c", str(clients), "-m", "POST", "-T", content_type,
               "-D", body_path, "-t", "60"]  # fmt: skip
    if auth:
        command += ["-a", auth]
    before = common.children_cpu_seconds()
    output = subprocess.run([*command, url], capture_output=True, text=True, check=True, timeout=seconds + 120).stdout
    cpu = common.children_cpu_seconds() - before
    return parse(output, clients, seconds, cpu)


def parse(output: str, clients: int, seconds: float, cpu: float) -> Load:
    def number(pattern: str) -> float:
        match = re.search(pattern, output)
        return float(match.group(1)) if match else float("nan")

    statuses = {int(code): int(count) for code, count in re.findall(r"\[(\d{3})\]\s+(\d+) responses", output)}
    _, _, error_lines = output.partition("Error distribution:")  # "[count]\tPost ...: <the error>" lines.
    errors = sum(int(count) for count in re.findall(r"^\s*\[(\d+)\]", error_lines, flags=re.MULTILINE))
    return Load(
        clients=clients,
        seconds=seconds,
        requests_per_second=number(r"Requests/sec:\s+([\d.]+)"),
        p50_ms=1000 * number(r"50% in ([\d.]+) secs"),
        p99_ms=1000 * number(r"99% in ([\d.]+) secs"),
        statuses=statuses,
        errors=errors,
        client_cpu_seconds=cpu,
    )
