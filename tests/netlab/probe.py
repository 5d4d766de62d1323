"""Small network probes the harness's own tests run inside namespaces (stdlib only).

- ``serve PORT``: a TCP server; each connection gets its peer address as a first line, then
  everything it sends echoed back. Prints ``{"ready": PORT}``; runs until stdin closes.
- ``connect IP PORT [--bind PORT] [--send BYTES] [--pings N] [--timeout S]``: prints
  ``{"peer": <the address the server saw>, "rtt": <seconds for a one-byte echo>, "rtts":
  <N more of them, one after the other>, "echo_ok": <BYTES random bytes came back intact>,
  "seconds": <time for that>}`` (or ``{"connect_error": ...}``).
- ``sink PORT``: a TCP server that reads each connection to its end, then answers one byte
  (the sender's proof that everything arrived). Prints ``{"ready": PORT}``; runs until stdin
  closes.
- ``spray PORT BYTES IP...``: sends ``BYTES`` to the sink at each IP at once (one connection
  each, in threads); prints ``{"seconds": <until every sink confirmed>}``.
- ``udp-sink PORT``: counts UDP datagrams; prints ``{"ready": PORT}``, then on each stdin
  line ``{"count": N}``.
- ``udp-send IP PORT N``: sends N one-byte datagrams.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time


def say(message: dict) -> None:
    print(json.dumps(message), flush=True)


def serve(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port), reuse_port=True)

    def handle(conn: socket.socket, address) -> None:
        with conn:
            conn.sendall(f"{address[0]}:{address[1]}\n".encode())
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            conn, address = server.accept()
            threading.Thread(target=handle, args=(conn, address), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    say({"ready": port})
    sys.stdin.read()


def recv_exactly(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("closed early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def connect(
    ip: str, port: int, bind: int | None, send: int, timeout: float, pings: int = 0
) -> None:
    conn = socket.socket()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(timeout)
    if bind is not None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        conn.bind(("0.0.0.0", bind))
    try:
        conn.connect((ip, port))
    except OSError as e:
        say({"connect_error": type(e).__name__})
        return
    peer = b""
    while not peer.endswith(b"\n"):
        peer += recv_exactly(conn, 1)
    result: dict = {"peer": peer.decode().strip()}
    started = time.perf_counter()
    conn.sendall(b"x")
    recv_exactly(conn, 1)
    result["rtt"] = time.perf_counter() - started
    if pings:
        result["rtts"] = []
        for _ in range(pings):
            started = time.perf_counter()
            conn.sendall(b"x")
            recv_exactly(conn, 1)
            result["rtts"].append(time.perf_counter() - started)
    if send:
        payload = os.urandom(send)
        started = time.perf_counter()
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.append(recv_exactly(conn, send)))
        reader.start()
        conn.sendall(payload)
        reader.join()
        result["seconds"] = time.perf_counter() - started
        result["echo_ok"] = received == [payload]
    conn.close()
    say(result)


def sink(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port), reuse_port=True)

    def handle(conn: socket.socket) -> None:
        with conn:
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    say({"ready": port})
    sys.stdin.read()


def spray(port: int, size: int, ips: list[str], timeout: float = 300.0) -> None:
    payload = os.urandom(min(size, 1 << 20))
    errors: list[str] = []

    def send(ip: str) -> None:
        try:
            with socket.create_connection((ip, port), timeout=timeout) as conn:
                left = size
                while left:
                    left -= conn.send(payload[: min(left, len(payload))])
                conn.shutdown(socket.SHUT_WR)
                if conn.recv(1) != b"k":
                    errors.append(f"{ip}: no confirmation")
        except OSError as e:
            errors.append(f"{ip}: {e!r}")

    threads = [threading.Thread(target=send, args=(ip,)) for ip in ips]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    say({"seconds": time.perf_counter() - started, "errors": errors})


def udp_sink(port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    sock.bind(("0.0.0.0", port))
    count = 0

    def receive() -> None:
        nonlocal count
        while True:
            sock.recv(2048)
            count += 1

    threading.Thread(target=receive, daemon=True).start()
    say({"ready": port})
    for _ in sys.stdin:
        say({"count": count})


def udp_send(ip: str, port: int, n: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(n):
        sock.sendto(b"x", (ip, port))
        time.sleep(0.0005)  # pacing, so the receiver's buffer is never the one dropping
    say({"sent": n})


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "serve":
        serve(int(args[0]))
    elif command == "connect":
        bind = int(args[args.index("--bind") + 1]) if "--bind" in args else None
        send = int(args[args.index("--send") + 1]) if "--send" in args else 0
        timeout = float(args[args.index("--timeout") + 1]) if "--timeout" in args else 20.0
        pings = int(args[args.index("--pings") + 1]) if "--pings" in args else 0
        connect(args[0], int(args[1]), bind, send, timeout, pings)
    elif command == "sink":
        sink(int(args[0]))
    elif command == "spray":
        spray(int(args[0]), int(args[1]), args[2:])
    elif command == "udp-sink":
        udp_sink(int(args[0]))
    elif command == "udp-send":
        udp_send(args[0], int(args[1]), int(args[2]))
    else:
        raise SystemExit(f"unknown command {command!r}")
