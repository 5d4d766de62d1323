"""A Python script running inside a namespace, driven with JSON lines over stdin/stdout."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

# The repository root: children import this checkout's ``swarmtrain`` (a script's own
# directory, not the cwd, comes first on its sys.path).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PeerProcess:
    """``python script *args`` inside namespace ``ns``; JSON lines both ways.

    A line ``{"error": ...}`` from the child raises ``RuntimeError``; other non-JSON output is
    ignored. ``recv`` and ``ask`` raise ``TimeoutError`` (with the child's stderr) instead of
    hanging; ``close`` asks the child to quit, kills it if it does not, and closes every pipe.
    """

    def __init__(self, ns: str, script: str, *args: str, env: dict | None = None):
        self.ns = ns
        self._stderr = tempfile.TemporaryFile(mode="w+")
        child_env = {**os.environ, **(env or {})}
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (REPO_ROOT, child_env.get("PYTHONPATH", "")) if p
        )
        try:
            self._proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, script, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                text=True,
                bufsize=1,
                env=child_env,
            )
        except BaseException:
            self._stderr.close()
            raise
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr(self, limit: int | None = 4000) -> str:
        """The child's stderr so far: its last ``limit`` characters (None: all of it)."""
        self._stderr.seek(0)
        text = self._stderr.read()
        return text if limit is None else text[-limit:]

    def recv(self, timeout: float) -> dict:
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no answer in {timeout} s; stderr:\n{self.stderr()}") from None
            if line is None:
                self._lines.put(None)  # later calls see the exit too
                self._proc.wait(timeout=5)
                raise RuntimeError(
                    f"the process exited ({self._proc.returncode}); stderr:\n{self.stderr()}"
                )
            if line.startswith("{"):
                message = json.loads(line)
                if "error" in message:
                    raise RuntimeError(f"the process failed: {message['error']}")
                return message

    def send(self, message: dict) -> None:
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()

    def ask(self, message: dict, timeout: float) -> dict:
        self.send(message)
        return self.recv(timeout)

    def request_quit(self) -> None:
        """Ask the child to quit (and close its stdin) without waiting for it."""
        if self._proc.poll() is None and not self._proc.stdin.closed:
            try:
                self.send({"op": "quit"})
                self._proc.stdin.close()
            except OSError:
                pass

    def close(self, timeout: float = 10.0) -> None:
        try:
            if self._proc.poll() is None:
                self.request_quit()
                try:
                    self._proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=10)
        finally:
            if not self._proc.stdin.closed:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass
            self._reader.join(timeout=10)
            self._proc.stdout.close()
            self._stderr.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
