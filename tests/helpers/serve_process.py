"""`specserve serve` as a subprocess in tests: wait for its ready line, find every process it started."""

import subprocess
import time

import psutil

READY = "specserve is serving"


def wait_until_serving(proc: subprocess.Popen, timeout_s: float = 400, log=None) -> str:
    """The server's ready line (it names the addresses); fails with its exit code (and the tail of `log`, a Path
    holding its stderr) when it exits or stays silent past the timeout."""
    line, deadline = "", time.time() + timeout_s
    while READY not in line and time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
    assert READY in line, f"no ready line (exit code {proc.poll()})" + (f": {log.read_text()[-3000:]}" if log else "")
    return line


def marked_processes(marker: str) -> list[psutil.Process]:
    """The live processes whose environment has SPECSERVE_TEST_MARKER=`marker`: a server started with it and every
    process that server started."""
    procs = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("SPECSERVE_TEST_MARKER") == marker:
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return procs
