#!/usr/bin/env python3
"""bench/store_attack.py STORE_PEER [scenario ...]: the store under attack.

Starts `STORE_PEER serve` (tests/peers/store_peer.cpp: a store_server on
127.0.0.1, options from the environment) and attacks it as a hostile or buggy
client would, printing one line of figures per scenario. Figures, not a test:
run it against two builds to compare (README, "The rendezvous store").

  fuzz      random and mutated frames for FUZZ_SECONDS (default 60): frames
            sent, the store's RSS every 10 s, whether good clients are served
  pipeline  2,000 pings in one write, then 20,000
  frames    6 connections each send a 128 MiB frame short of its last byte
  get       a 64 MiB value fetched by 6 connections that never read the reply
  wait      one wait on 4,096 never-set 4 KiB keys
  idle      3,000 connections that finish the handshake and go silent
  fds       with the descriptor limit at 1,024: 1,500 silent connections, then a good client
  stranger  a client without the token tries to read and write a key

The attacker knows the token (DTRAIN_STORE_TOKEN, default "attack") unless
the scenario says otherwise: a buggy rank, the worst insider.
"""
import os
import random
import resource
import socket
import struct
import subprocess
import sys
import threading
import time

MAGIC = 0x5A525444
VERSION = 2  # include/dtrain/rendezvous/protocol.hpp: wire::version
TOKEN = os.environ.get("DTRAIN_STORE_TOKEN", "attack")
OPS = dict(set=1, get=2, add=3, compare_set=4, wait=5, check=6, erase=7, num_keys=8, ping=9)


class Store:
    def __init__(self, peer, env=None, preexec=None):
        e = dict(os.environ)
        e["DTRAIN_STORE_TOKEN"] = TOKEN
        e.update(env or {})
        self.proc = subprocess.Popen([peer, "serve"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=e, preexec_fn=preexec)
        self.port = int(self.proc.stdout.readline())
        self.log_bytes = 0
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.log_bytes += len(line)

    def rss_mib(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS"):
                        return int(line.split()[1]) // 1024
        except OSError:
            return None

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        status = self.proc.poll()
        if status is None:
            self.proc.kill()
            self.proc.wait()
        return status


def b32(s):
    return struct.pack("<I", len(s)) + s


def frame(body):
    return struct.pack("<I", len(body)) + body


def connect(port, token=TOKEN, timeout=10):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    t = token.encode()
    s.sendall(struct.pack("<IHH", MAGIC, VERSION, len(t)) + t)
    reply = b""
    while len(reply) < 3 + 8:  # status, version, the server's instance
        got = s.recv(3 + 8 - len(reply))
        if not got:
            break
        reply += got
    if len(reply) != 3 + 8 or reply[0] != 0:
        raise ConnectionError(f"handshake refused: {reply!r}")
    return s


def call(s, body):
    s.sendall(frame(body))
    head = b""
    while len(head) < 4:
        got = s.recv(4 - len(head))
        if not got:
            raise ConnectionError("closed")
        head += got
    (n,) = struct.unpack("<I", head)
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out


def good_client_served(port):
    try:
        s = connect(port)
        key = b"good/%d" % random.randrange(1 << 30)
        ok = call(s, bytes([OPS["set"]]) + b32(key) + b32(b"v"))[0] == 0
        ok = ok and call(s, bytes([OPS["get"]]) + b32(key) + struct.pack("<Q", 1000))[5:] == b"v"
        s.close()
        return ok
    except OSError:
        return False


def random_frame(rng):
    kind = rng.random()
    op = rng.choice(list(OPS.values()) + [0, 10, 255])
    if kind < 0.3:  # well-formed
        key = rng.randbytes(rng.randrange(0, 64))
        if op in (1,):
            body = bytes([op]) + b32(key) + b32(rng.randbytes(rng.randrange(0, 256)))
        elif op in (2, 5):
            body = bytes([op]) + (b32(key) if op == 2 else struct.pack("<I", 1) + b32(key)) + struct.pack("<Q", rng.randrange(0, 50))
        elif op == 3:
            body = bytes([op]) + b32(key) + struct.pack("<q", rng.randrange(-5, 5))
        else:
            body = bytes([op]) + rng.randbytes(rng.randrange(0, 32))
        return frame(body)
    if kind < 0.6:  # random bytes in a frame
        return frame(rng.randbytes(rng.randrange(0, 200)))
    if kind < 0.8:  # lying lengths
        return struct.pack("<I", rng.choice([0, 1, 0xFFFFFFFF, 1 << 27, rng.randrange(1 << 32)])) + rng.randbytes(rng.randrange(0, 64))
    return rng.randbytes(rng.randrange(1, 300))  # noise


def fuzz(peer):
    seconds = float(os.environ.get("FUZZ_SECONDS", "60"))
    store = Store(peer, {"DTRAIN_STORE_IO_TIMEOUT": "1"})
    frames = 0
    counts = {"frames": 0}
    stop = time.time() + seconds
    rss = []

    def worker(seed):
        rng = random.Random(seed)
        while time.time() < stop:
            try:
                s = connect(store.port, timeout=2) if rng.random() < 0.8 else socket.create_connection(("127.0.0.1", store.port), timeout=2)
                s.settimeout(0.05)
                for _ in range(rng.randrange(1, 50)):
                    s.sendall(random_frame(rng))
                    counts["frames"] += 1
                    try:
                        s.recv(65536)
                    except (socket.timeout, BlockingIOError):
                        pass
                s.close()
            except OSError:
                pass

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    next_sample = time.time()
    served = True
    while time.time() < stop:
        if time.time() >= next_sample:
            rss.append(store.rss_mib())
            served = served and good_client_served(store.port)
            next_sample += 10
        time.sleep(0.2)
    for t in threads:
        t.join()
    served = served and good_client_served(store.port)
    alive = store.alive()
    status = store.stop()
    print(f"fuzz: {counts['frames']:,} frames in {seconds:.0f} s; store RSS every 10 s (MiB): {rss}; "
          f"good clients served throughout: {served}; store alive: {alive} (exit {status}); "
          f"log {store.log_bytes:,} bytes")


def pipeline(peer):
    for n in (2000, 20000):
        store = Store(peer)
        s = connect(store.port)
        s.sendall(frame(bytes([OPS["ping"]])) * n)
        got = 0
        s.settimeout(10)
        try:
            while got < 5 * n:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                got += len(chunk)
        except OSError:
            pass
        time.sleep(0.2)
        alive = store.alive()
        print(f"pipeline: {n:,} pings in one write: {got // 5:,} answered; store alive: {alive} (exit {store.stop()})")


def frames(peer):
    store = Store(peer)
    size = 128 << 20
    peak = [store.rss_mib()]

    def hog():
        try:
            s = connect(store.port, timeout=60)
            body_head = bytes([OPS["set"]]) + b32(b"k") + struct.pack("<I", size - 10)
            s.sendall(struct.pack("<I", size) + body_head)
            left = size - len(body_head) - 1
            chunk = b"x" * (1 << 20)
            while left > 0:
                n = min(left, len(chunk))
                s.sendall(chunk[:n])
                left -= n
            time.sleep(60)
        except OSError:
            pass

    for _ in range(6):
        threading.Thread(target=hog, daemon=True).start()
    for _ in range(20):
        time.sleep(1)
        peak.append(store.rss_mib() or 0)
    print(f"frames: 6 x 128 MiB frames short of one byte: store RSS peak {max(peak)} MiB; "
          f"good client served meanwhile: {good_client_served(store.port)}")
    store.stop()


def get(peer):
    store = Store(peer)
    s = connect(store.port, timeout=60)
    call(s, bytes([OPS["set"]]) + b32(b"big") + b32(b"v" * (64 << 20)))
    base = store.rss_mib()
    socks = []
    for _ in range(6):
        c = connect(store.port, timeout=60)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.sendall(frame(bytes([OPS["get"]]) + b32(b"big") + struct.pack("<Q", 1000)))
        socks.append(c)
    peak = base
    for _ in range(10):
        time.sleep(1)
        peak = max(peak, store.rss_mib() or 0)
    print(f"get: a 64 MiB value, 6 gets whose replies are never read: store RSS {base} -> {peak} MiB; "
          f"good client served meanwhile: {good_client_served(store.port)}")
    store.stop()


def wait(peer):
    store = Store(peer)
    base = store.rss_mib()
    s = connect(store.port, timeout=60)
    keys = b"".join(b32(b"%04d" % i + b"k" * 4092) for i in range(4096))
    s.sendall(frame(bytes([OPS["wait"]]) + struct.pack("<I", 4096) + keys + struct.pack("<Q", 600_000)))
    time.sleep(3)
    print(f"wait: one wait on 4,096 never-set 4 KiB keys: store RSS {base} -> {store.rss_mib()} MiB")
    store.stop()


def idle(peer):
    timeout = os.environ.get("IDLE_TIMEOUT", "30")
    store = Store(peer, {"DTRAIN_STORE_IDLE_TIMEOUT": timeout})
    socks = []
    for _ in range(3000):
        try:
            socks.append(connect(store.port))
        except OSError:
            break
    opened = len(socks)
    time.sleep(float(timeout) + 15)
    still = 0
    for s in socks:
        s.setblocking(False)
        try:
            if s.recv(1):  # data instead of the end of the stream: still open
                still += 1
        except BlockingIOError:
            still += 1
        except OSError:
            pass
    print(f"idle: {opened:,} silent connections after the handshake; open {float(timeout) + 15:.0f} s later "
          f"(DTRAIN_STORE_IDLE_TIMEOUT={timeout}): {still:,}")
    store.stop()


def fds(peer):
    def low():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    store = Store(peer, preexec=low)
    socks = []
    for _ in range(1500):
        try:
            s = socket.create_connection(("127.0.0.1", store.port), timeout=2)
            socks.append(s)
        except OSError:
            break
    time.sleep(2)
    served = good_client_served(store.port)
    print(f"fds: ulimit -n 1024, {len(socks):,} silent connections: a good client is served: {served}; "
          f"store log {store.log_bytes:,} bytes after 2 s")
    store.stop()


def stranger(peer):
    store = Store(peer)
    try:
        connect(store.port, token="guess")
        result = "served"
    except (OSError, ConnectionError) as e:
        result = f"refused ({e})"
    try:
        connect(store.port, token="")
        result2 = "served"
    except (OSError, ConnectionError) as e:
        result2 = f"refused ({e})"
    print(f"stranger: wrong token: {result}; no token: {result2}")
    store.stop()


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    peer = sys.argv[1]
    names = sys.argv[2:] or ["pipeline", "stranger", "frames", "get", "wait", "fds", "idle", "fuzz"]
    for name in names:
        globals()[name](peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
