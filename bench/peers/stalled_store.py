"""The gateway's memory while its store is stalled under large answers.

Starts a Redis server of its own, an upstream that answers each POST with ANSWER_KB of
JSON after a short pause, and `idem gateway` on that Redis. N clients POST at once, each with
a key of its own; while their requests are at the upstream, the Redis server is stopped
(SIGSTOP, so its connections stall rather than break). Prints the gateway's RSS over time
(baseline before, peak, after the clients are answered), how long the clients waited and what
they were answered; then resumes Redis and prints what a retry of every key gets.

    python3 bench/peers/stalled_store.py --idem target/debug/idem --answers 1000 --kb 300
"""

import argparse
import collections
import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def upstream(port: int, body: bytes, pause: float) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            time.sleep(pause)
            self.send_response(201)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def post(port: int, key: str, timeout: float) -> tuple[int, str, float]:
    started = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/orders", body=b"{}", headers={
            "idempotency-key": key, "content-type": "application/json",
            "authorization": "Bearer bench"})
        res = conn.getresponse()
        data = res.read()
        code = ""
        if res.status >= 400:
            try:
                code = json.loads(data).get("code", "")
            except ValueError:
                code = "?"
        conn.close()
        return res.status, code, time.monotonic() - started
    except Exception as e:  # noqa: BLE001 - every failure is reported as such
        return 0, type(e).__name__, time.monotonic() - started


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idem", required=True)
    ap.add_argument("--answers", type=int, default=1000)
    ap.add_argument("--kb", type=int, default=300)
    ap.add_argument("--redis-server", default="redis-server")
    ap.add_argument("--stalled", type=float, default=30.0, help="seconds the store stays stopped")
    ap.add_argument("--extra", default="", help="more gateway flags")
    ap.add_argument("--no-stall", action="store_true",
                    help="leave the store running: the same load's peak, for comparison")
    args = ap.parse_args()

    body = json.dumps({"pad": "x" * (args.kb * 1024 - 12)}).encode()
    tmp = tempfile.mkdtemp()
    rport, uport, gport = free_port(), free_port(), free_port()
    redis = subprocess.Popen([args.redis_server, "--port", str(rport), "--save", "",
                              "--appendonly", "no", "--dir", tmp],
                             stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    up = upstream(uport, body, pause=2.0)
    gw = subprocess.Popen([args.idem, "gateway", "--listen", f"127.0.0.1:{gport}",
                           "--upstream", f"http://127.0.0.1:{uport}",
                           "--store", f"redis://127.0.0.1:{rport}",
                           "--max-connections", str(args.answers * 2 + 100)]
                          + args.extra.split(),
                          stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", gport), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        base = rss_mb(gw.pid)
        results: list[tuple[int, str, float]] = []
        lock = threading.Lock()

        def client(i: int) -> None:
            r = post(gport, f"k-{i}", timeout=300)
            with lock:
                results.append(r)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.answers)]
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(1.0)  # the requests have claimed their keys and wait at the upstream
        if not args.no_stall:
            redis.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        peak = base
        answered_at = None
        while time.monotonic() - stopped_at < args.stalled:
            peak = max(peak, rss_mb(gw.pid))
            with lock:
                if answered_at is None and len(results) == args.answers:
                    answered_at = time.monotonic() - started
            time.sleep(0.2)
        at_resume = rss_mb(gw.pid)
        redis.send_signal(signal.SIGCONT)
        for t in threads:
            t.join(timeout=300)
        with lock:
            answered = collections.Counter(f"{s} {c}".strip() for s, c, _ in results)
            waits = sorted(w for _, _, w in results)
        print(f"gateway RSS: baseline {base:.0f} MB, peak while stalled {peak:.0f} MB, "
              f"at resume {at_resume:.0f} MB")
        print(f"answers: {dict(answered)}")
        if waits:
            print(f"client waits: median {waits[len(waits)//2]:.1f} s, max {waits[-1]:.1f} s, "
                  f"all answered {'within ' + format(answered_at, '.1f') + ' s' if answered_at else 'after the stall'}")
        time.sleep(5)
        retried = collections.Counter()
        for i in range(args.answers):
            s, c, _ = post(gport, f"k-{i}", timeout=60)
            retried[f"{s} {c}".strip()] += 1
        print(f"retries after the store resumed: {dict(retried)}; RSS {rss_mb(gw.pid):.0f} MB")
    finally:
        gw.kill()
        redis.send_signal(signal.SIGCONT)
        redis.kill()
        up.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
