"""Three hosts on one machine: network namespaces on a bridge, with optional ``tc netem`` delays.

    cache host   10.X.Y.1   redis-server (its loopback) + card-cache
    target host  10.X.Y.2   card-target
    draft host   10.X.Y.3   card-draft
    this process            the bridge, 10.X.Y.254 (dials the target like a user)

Every service runs from its entry point (``ip netns exec HOST card-...``), with the tokens and
mutual TLS on every link (certificates made here, naming each host's address). ``delay_ms`` puts
that one-way delay on both directions of the target's and the draft's links (a Step round trip
gains 2 x delay_ms).

As a test fixture: ``NetnsTrio``. For measurements (needs root, iproute2, and sch_netem for delays):

    python -m tests.services.netns --delay-ms 1 -- card-bench --modes svc-vanilla,svc-card --services ...

runs the command with CARD_BENCH_TARGET_ADDR and CARD_BENCH_TLS_* pointing at the trio.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from card.client.trio import ServiceProcess, console_script, die_with_parent, tls_env
from card.common.tls import TlsConfig
from card.engine.shared.errors import Unavailable
from tests.services.certs import make_pki

HOSTS = ("cache", "target", "draft")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Unsupported(Exception):
    """Namespaces (or netem) cannot be made here: no root, no iproute2, a kernel without it."""


class Hosts:
    def __init__(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise Unsupported("network namespaces need root and iproute2 (ip)")
        self.tag = uuid.uuid4().hex[:5]
        self.bridge = f"cbr{self.tag}"
        net = f"10.{random.randrange(200, 250)}.{random.randrange(0, 255)}"
        self.addr = {h: f"{net}.{i + 1}" for i, h in enumerate(HOSTS)}
        self.gateway = f"{net}.254"
        self.ns = {h: f"card-{self.tag}-{h}" for h in HOSTS}
        self.made: list[str] = []
        try:
            self._build()
        except (subprocess.CalledProcessError, OSError) as exc:
            self.close()
            detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
            raise Unsupported(f"cannot create network namespaces here: {detail}") from None

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append("bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(HOSTS):
            ns, outer, inner = self.ns[host], f"c{self.tag}{i}r", f"c{self.tag}{i}n"
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def delay(self, host: str, ms: float) -> None:
        """``ms`` one-way on both directions of ``host``'s link. Unsupported without sch_netem."""
        i = HOSTS.index(host)
        for cmd in (["ip", "netns", "exec", self.ns[host], "tc", "qdisc", "add", "dev", "eth0"],
                    ["tc", "qdisc", "add", "dev", f"c{self.tag}{i}r"]):
            done = subprocess.run([*cmd, "root", "netem", "delay", f"{ms}ms"], capture_output=True, text=True,
                                  timeout=30)
            if done.returncode != 0:
                raise Unsupported(f"tc netem is not available here: {done.stderr.strip()}")

    def close(self) -> None:
        for name in reversed(self.made):
            if name == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
            else:  # its veth end goes with it
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.made.clear()


class NetnsTrio:
    """Redis + card-cache, card-target and card-draft on three hosts, tokens and mutual TLS on."""

    def __init__(self, target_model: str, draft_model: str, *, draft_quantize: str = "none",
                 dtype: str = "auto", threads: tuple[int, int] = (1, 1), delay_ms: float = 0.0,
                 log_dir: Path | None = None, extra_args: dict[str, list[str]] | None = None,
                 start_timeout_s: float = 300.0) -> None:
        self.hosts = Hosts()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="card-netns-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: list[ServiceProcess] = []
        self.redis: subprocess.Popen | None = None
        try:
            if delay_ms:
                for host in ("target", "draft"):
                    self.hosts.delay(host, delay_ms)
            pki = make_pki(self.log_dir / "pki", hosts=(*self.hosts.addr.values(), "localhost"))
            self.tls = pki.tls()
            self.draft_token, self.target_token = uuid.uuid4().hex, uuid.uuid4().hex
            self._start(target_model, draft_model, draft_quantize, dtype, threads, extra_args or {},
                        start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _spawn(self, host: str, script: str, args: list[str], env: dict[str, str | None]) -> ServiceProcess:
        log_path = self.log_dir / f"{script}.log"
        cmd = die_with_parent(["ip", "netns", "exec", self.hosts.ns[host], console_script(script), *args,
                               "--host", self.hosts.addr[host], "--port", "0", "--metrics-port", "0"])
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                    **{k: v for k, v in env.items() if v is not None}}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, start_new_session=True)
        service = ServiceProcess(script, proc, log_path, tls=self.tls)
        self.processes.append(service)
        return service

    def _start(self, target_model: str, draft_model: str, draft_quantize: str, dtype: str,
               threads: tuple[int, int], extra: dict[str, list[str]], timeout_s: float) -> None:
        redis_port = 6379  # the cache host's own loopback: nothing else listens there
        with open(self.log_dir / "redis.log", "wb") as log:
            self.redis = subprocess.Popen(
                die_with_parent(["ip", "netns", "exec", self.hosts.ns["cache"],
                                 shutil.which("redis-server") or "redis-server", "--port", str(redis_port),
                                 "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", str(self.log_dir)]),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        mutual = TlsConfig(self.tls.cert, self.tls.key, self.tls.ca, client_auth=True)
        cache = self._spawn("cache", "card-cache", ["--redis-url", f"redis://127.0.0.1:{redis_port}/0",
                                                    *extra.get("cache", [])],
                            {"CARD_CACHE_DRAFT_TOKEN": self.draft_token,
                             "CARD_CACHE_TARGET_TOKEN": self.target_token,
                             **tls_env("CARD_CACHE", mutual)})
        self.cache_addr = cache.wait_listening(timeout_s)
        cache.wait_serving(timeout_s)
        draft = self._spawn("draft", "card-draft", [
            "--cache", self.cache_addr, "--model", draft_model, "--quantize", draft_quantize,
            "--dtype", dtype, "--threads", str(threads[1]), "--name", "remote", *extra.get("draft", [])],
            {"CARD_DRAFT_DRAFT_TOKEN": self.draft_token, **tls_env("CARD_DRAFT", self.tls)})
        target = self._spawn("target", "card-target", [
            "--cache", self.cache_addr, "--model", target_model, "--dtype", dtype, "--no-http",
            "--threads", str(threads[0]), *extra.get("target", [])],
            {"CARD_TARGET_TARGET_TOKEN": self.target_token, **tls_env("CARD_TARGET", self.tls)})
        draft.wait_listening(timeout_s)
        self.target_addr = target.wait_listening(timeout_s)
        draft.wait_serving(timeout_s)
        target.wait_serving(timeout_s)

    def close(self) -> None:
        for group in ([p for p in self.processes if p.name != "card-cache"],
                      [p for p in self.processes if p.name == "card-cache"]):
            for p in group:
                p.terminate()
            for p in group:
                if p.wait(20) is None:
                    p.kill()
                    p.wait(5)
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            self.redis.wait(10)
        self.hosts.close()

    def __enter__(self) -> NetnsTrio:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--target-model", default="default")
    parser.add_argument("--draft-model", default="default")
    parser.add_argument("--draft-quantize", default="none")
    parser.add_argument("--target-threads", type=int, default=1)
    parser.add_argument("--draft-threads", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        with NetnsTrio(args.target_model, args.draft_model, draft_quantize=args.draft_quantize,
                       threads=(args.target_threads, args.draft_threads), delay_ms=args.delay_ms) as trio:
            env = {**os.environ, "CARD_BENCH_TARGET_ADDR": trio.target_addr,
                   **{k: v for k, v in tls_env("CARD_BENCH", trio.tls).items() if v},
                   "CARD_CLIENT_TARGET_ADDR": trio.target_addr,
                   **{k: v for k, v in tls_env("CARD_CLIENT", trio.tls).items() if v}}
            print(f"trio up: target {trio.target_addr}, cache {trio.cache_addr}, delay {args.delay_ms} ms "
                  f"one-way on the target's and the draft's links; logs {trio.log_dir}", file=sys.stderr)
            return subprocess.run(command, env=env).returncode if command else 0
    except (Unsupported, Unavailable) as exc:
        print(f"netns: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
