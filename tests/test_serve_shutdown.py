"""Ctrl-C on `pagedllm serve` with requests in flight: a real server process, a streaming client
mid-answer and a non-streamed request still running, then SIGINT."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import psutil
import pytest

from test_server import ServerProcess, free_port

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

httpx = pytest.importorskip("httpx")

# Far more tokens than the server can produce before the signal, whatever the machine's speed:
# both requests are certainly still running when it arrives.
LONG = {
    "model": "default",
    "max_tokens": 3000,
    "ignore_eos": True,
    "temperature": 0.0,
    "messages": [{"role": "user", "content": "Count to ten thousand."}],
}


def _half_sent_request(port: int) -> socket.socket:
    """A client still sending its body: its handler waits for bytes that never come."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model": '
    )
    s.settimeout(30)
    return s


def _in_flight(srv: ServerProcess) -> float:
    m = srv.metrics()
    return m["pagedllm_num_requests_running"] + m["pagedllm_num_requests_waiting"]


def test_sigint_ends_streams_and_pending_requests_and_exits_cleanly(tmp_path, smollm2_gguf_path):
    port = free_port()
    srv = ServerProcess(
        [
            "serve",
            "--port",
            str(port),
            "--pa-ctxt-len",
            "8192",
            "--max-model-len",
            "4096",
            "--served-model-name",
            "smol",
            "default",
        ],
        port,
        tmp_path / "serve.log",
    )
    try:
        srv.wait_ready()
        url = f"{srv.url}/v1/chat/completions"
        pending: dict = {}

        def non_streamed() -> None:
            r = httpx.post(url, json=LONG, timeout=120)
            pending["status"], pending["body"] = r.status_code, r.json()

        worker = threading.Thread(target=non_streamed)
        worker.start()
        events: list[str] = []
        # "default" is an alias here; responses carry the first name.
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for line in lines:  # read until the answer has started
                if line.startswith("data: "):
                    events.append(line[6:])
                    if json.loads(events[-1])["choices"][0]["delta"].get("content"):
                        break
            deadline = time.time() + 60
            while _in_flight(srv) < 2:  # the non-streamed request is in the engine too
                assert time.time() < deadline, "the non-streamed request never reached the engine"
                time.sleep(0.05)
            slow = _half_sent_request(port)
            children = psutil.Process(srv.proc.pid).children(recursive=True)
            log_before = srv.log()
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGINT)
            events += [line[6:] for line in lines if line.startswith("data: ")]
        code = srv.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        worker.join(30)
        slow_answer = slow.recv(4096).decode()
    finally:
        srv.stop()
    log = srv.log()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])
    assert error["error"]["type"] == "server_error" and "shutting down" in error["error"]["message"]
    assert all(json.loads(e)["model"] == "smol" for e in events[:-2])  # the answer's chunks, then the error
    assert pending["status"] == 503, pending
    assert "shutting down" in pending["body"]["error"]["message"]
    assert slow_answer.startswith("HTTP/1.1 503") and "shutting down" in slow_answer, slow_answer
    assert elapsed < 2.0, f"exit took {elapsed:.2f} s"
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]
    new_lines = log[len(log_before) :].strip().splitlines()
    assert len(new_lines) == 1 and new_lines[0].startswith("stopped by SIGINT: 2 request(s)"), new_lines
    assert new_lines[0].endswith("0 KV blocks in use")
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_second_sigint_exits_at_once(tmp_path, smollm2_gguf_path):
    port = free_port()
    srv = ServerProcess(["serve", "--port", str(port), "--pa-gpu-mem", "64"], port, tmp_path / "serve.log")
    try:
        srv.wait_ready()
        slow = _half_sent_request(port)  # holds the graceful shutdown for its grace period
        time.sleep(0.2)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        srv.proc.send_signal(signal.SIGINT)
        code = srv.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        slow.close()
    finally:
        srv.stop()
    log = srv.log()
    assert code == 130 and "second interrupt: exiting now" in log, log[-3000:]
    assert elapsed < 1.0, f"exit took {elapsed:.2f} s"
    assert "Traceback" not in log, log[-5000:]


def test_busy_port_fails_at_once_with_one_line(tmp_path, smollm2_gguf_path):
    """The port is opened before the model loads: a taken one is reported in one line, with no
    load first (the process is gone in about the time Python and the CLI take to start)."""
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "pagedllm.cli.main", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines == [
        f"error: port {port} on 127.0.0.1 is already in use (another server?): stop it or pick another with --port N"
    ], r.stderr
    assert elapsed < 10, f"{elapsed:.1f} s"  # about 0.3 s on a quiet machine; never a model load
    from pathlib import Path

    page = " ".join((Path(__file__).resolve().parent.parent / "docs" / "server.md").read_text().split())
    assert f"`{lines[0].replace(str(port), '8000')}`" in page, "docs/server.md quotes another message"


def test_serve_killed_during_start_leaves_nothing_behind(tmp_path, smollm2_gguf_path):
    """SIGKILL during a start (mid-load), then a new `serve` on the same port: it is ready within
    a normal start's time. Nothing a start does may leave state behind (the kernels' JIT lock
    once did: the next start slept on it forever); a fresh torch extensions folder for all three
    processes makes sure no earlier run's cache hides that."""
    import os

    env_dir = tmp_path / "torch_extensions"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(env_dir)  # inherited by the servers started here
    try:
        port = free_port()
        args = ["serve", "--port", str(port), "--pa-gpu-mem", "64"]
        killed = ServerProcess(args, port, tmp_path / "killed.log")
        t0 = time.monotonic()
        while "loading" not in killed.log() and killed.proc.poll() is None and time.monotonic() - t0 < 300:
            time.sleep(0.05)
        time.sleep(1.0)  # inside the load
        assert killed.proc.poll() is None, killed.log()
        killed.proc.kill()
        killed.proc.wait()
        killed.stop()

        after = ServerProcess(args, port, tmp_path / "after.log")
        try:
            t_after = after.wait_ready()
        finally:
            after.stop()
        normal = ServerProcess(args, port, tmp_path / "normal.log")
        try:
            t_normal = normal.wait_ready()
        finally:
            normal.stop()
    finally:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    assert t_after <= 2 * t_normal + 10, f"start after a SIGKILL {t_after:.1f} s, a normal start {t_normal:.1f} s"
