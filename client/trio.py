"""A local trio (redis, card-cache, card-draft, card-target) as subprocesses, for one machine.

    with LocalTrio(target_model="default", draft_model="default", draft_quantize="int8") as trio:
        generate_remote(trio.target_addr, "Hello")

Every service is started through its console script, exactly as a user would, on an OS-chosen
loopback port (read from its ``... listening on HOST:PORT`` line) unless a port is given; the
trio waits until each one reports SERVING through grpc.health.v1. Redis: a private
``redis-server`` on a free loopback port when the binary exists, else the cache's in-process
store (``memory://``, with a warning). On exit: SIGTERM to everything (target and drafts first,
so sessions end and workers unregister while the cache still runs), SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from card.client.options import default_thread_split
from card.common.channels import health_status
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.shared.config import NGRAM, NgramConfig, TreeParams
from card.engine.shared.errors import Unavailable

LISTENING = re.compile(r"^(card-\w+) listening on (\S+):(\d+)\s*$", re.MULTILINE)
HTTP_LISTENING = re.compile(r"^card-target http listening on (\S+):(\d+)\s*$", re.MULTILINE)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # the Linux default


def free_port() -> int:
    """A loopback port free right now, for programs that cannot bind port 0 themselves.

    Taken from below the ephemeral range when there is room: the services started beside it bind
    port 0, and the OS hands those out from the ephemeral range, so the two never collide.
    """
    low, _ = _ephemeral_range()
    if low > 11000:
        for port in random.sample(range(10000, low), 64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Run by a fresh interpreter between fork and the service's exec: arm PR_SET_PDEATHSIG (kept
# across exec), give up if the parent already died, then become the service.
_GUARD = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
          "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


def die_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that the child gets SIGTERM when the process that started it dies, however
    it dies (SIGKILL, the OOM killer), and no service outlives it as an orphan. Linux only
    (prctl PR_SET_PDEATHSIG); elsewhere ``cmd`` as is. The signal follows the *thread* that
    forked: start trios from a thread that lives as long as they should (the main thread, as
    card-client and card-bench do).

    Why not ``preexec_fn``: it makes Python fork() rather than vfork(), which runs gRPC's atfork
    handlers in the child; grpcio >= 1.81 then restarts its poller there, which dies on the
    descriptors ``close_fds`` closes (SIGABRT before exec, grpc/grpc#43055) in any process that
    has used a channel, as card-bench and the tests have."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), *cmd]


def console_script(name: str) -> str:
    """The entry point installed beside this interpreter (the venv), else one on PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise Unavailable(f"{name} is not installed; run `pip install -e .` in the project (or `make setup`)")
    return found


@dataclass
class ServiceProcess:
    """One child process, its log file and (once announced) its gRPC address."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    addr: str = ""
    metrics_port: int = 0
    tls: TlsConfig = PLAINTEXT  # how to dial its health service

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def _died(self) -> Unavailable:
        return Unavailable(f"{self.name} exited with code {self.proc.returncode} while starting; "
                           f"its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def wait_listening(self, timeout_s: float, line: re.Pattern = LISTENING) -> str:
        """The address from the ``listening on`` line (loopback when it bound every interface);
        ``line``: another announcement (HTTP_LISTENING), whose address is returned, not kept."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                match = line.search(self.log_path.read_text(errors="replace"))
            except OSError:
                match = None
            if match and match.lastindex:
                host, port = match.group(match.lastindex - 1), match.group(match.lastindex)
                if host in ("0.0.0.0", "[::]", "::", ""):
                    host = "127.0.0.1"
                if line is not LISTENING:
                    return f"{host}:{port}"
                self.addr = f"{host}:{port}"
                return self.addr
            if self.proc.poll() is not None:
                raise self._died()
            time.sleep(0.05)
        raise Unavailable(f"{self.name} did not announce its port within {timeout_s:g}s; "
                          f"log: {self.log_path}")

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._died()
            try:
                last = health_status(self.addr, timeout_s=1.0, tls=self.tls)
                if last == "SERVING":
                    return
            except grpc.RpcError as err:
                last = err.code().name if isinstance(err, grpc.Call) else str(err)
            time.sleep(0.1)
        raise Unavailable(f"{self.name} at {self.addr} is not SERVING after {timeout_s:g}s (last: {last}); "
                          f"log: {self.log_path}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None


def tls_env(prefix: str, tls: TlsConfig) -> dict[str, str | None]:
    """``tls`` as the CARD_<SERVICE>_TLS_* variables of one service (card.common.cli.tls_options)."""
    return {f"{prefix}_TLS_CERT": tls.cert, f"{prefix}_TLS_KEY": tls.key, f"{prefix}_TLS_CA": tls.ca,
            f"{prefix}_TLS_CLIENT_AUTH": "1" if tls.client_auth else None,
            f"{prefix}_TLS_SERVER_NAME": tls.server_name}


def service_args(tree: TreeParams) -> dict[str, list[str]]:
    """The flags that give the services ``tree``: its shape to card-draft, its chain fields to
    card-cache. The one place a TreeParams becomes command lines (card-client, card-bench)."""
    return {
        "draft": ["--tree-width", str(tree.width), "--branch", str(tree.branch),
                  "--max-depth", str(tree.max_depth)],
        "cache": ["--max-chain", str(tree.max_chain), "--min-path-prob", str(tree.min_path_prob),
                  "--b-extension" if tree.b_extension else "--no-b-extension"],
    }


def ngram_args(ngram: NgramConfig) -> list[str]:
    """``ngram`` as card-draft's --ngram-* flags (card.common.cli.ngram_options)."""
    args = ["--ngram-max-order", str(ngram.max_order), "--ngram-min-order", str(ngram.min_order),
            "--ngram-table-mb", str(ngram.table_mb), "--ngram-lookahead", str(ngram.lookahead)]
    return [*args, "--ngram-corpus", ngram.corpus] if ngram.corpus else args


@dataclass
class LocalTrio:
    """Parameters: models (spec, quantize), torch threads per process (None = split the cores),
    log_dir (None = a temporary folder, removed after a clean exit), redis_url (None = start a
    private redis-server, or memory:// when the binary is missing), fixed ports (0 = OS-chosen),
    metrics (give each service a free metrics port, see ``metrics_ports``), tree (None = each
    service's hardware default; else ``service_args(tree)``, before any ``extra_args``);
    draft_model "ngram": a model-free draft for the target's tokenizer; cascade "ngram": n-gram
    statistics beneath the draft model; ngram: their settings (None: card-draft's defaults)."""

    target_model: str = "default"
    draft_model: str = "default"
    draft_quantize: str = "none"
    cascade: str = "none"
    ngram: NgramConfig | None = None
    target_threads: int | None = None
    draft_threads: int | None = None
    log_dir: Path | None = None
    redis_url: str | None = None
    require_redis: bool = False
    target_port: int = 0
    cache_port: int = 0
    draft_port: int = 0
    draft_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    metrics: bool = False
    # the target's OpenAI-compatible front (0 = OS-chosen; ``http_addr``); None: --no-http (card-target
    # serves it on 8000 by default, which two trios on one machine would fight for)
    http_port: int | None = None
    http_host: str | None = None  # None: loopback, as the target's --host
    served_model_names: Sequence[str] = ()  # card-target --served-model-name (none: the model spec)
    api_key: str | None = field(default=None, repr=False)  # card-target --api-key (both its APIs)
    # the cache's tokens (card.common.auth), handed to the side that presents each; None = open
    draft_token: str | None = field(default=None, repr=False)
    target_token: str | None = field(default=None, repr=False)
    operator_token: str | None = field(default=None, repr=False)  # Drain, SetPoolWeights (card-client drafts)
    # every gRPC link (card.common.tls): each service serves this certificate and dials with it
    tls: TlsConfig = PLAINTEXT
    start_timeout_s: float = 600.0
    grace_s: float = 10.0
    tree: TreeParams | None = None
    exact: bool = True  # card-target --exact on|off
    speculation: str | None = None  # card-target --speculation (auto, always, never); None: its default
    extra_args: dict[str, Sequence[str]] = field(default_factory=dict)  # per service: "cache", ...

    def __post_init__(self) -> None:
        if self.tree is not None:
            tree_args = service_args(self.tree)
            self.extra_args = {name: [*tree_args.get(name, ()), *self.extra_args.get(name, ())]
                               for name in {*tree_args, *self.extra_args}}
        _, d = default_thread_split()
        # the target may use every core: its forwards drop to fewer threads while the draft worker's
        # (or anything else's) hold cores (card-target --adaptive-threads, on by default)
        self.target_threads = self.target_threads or os.cpu_count() or 1
        self.draft_threads = self.draft_threads or d
        self.processes: list[ServiceProcess] = []
        self.drafts: list[ServiceProcess] = []
        self.redis: subprocess.Popen | None = None
        self.warnings: list[str] = []
        self._own_log_dir = self.log_dir is None
        self.target_addr = self.cache_addr = self.draft_addr = self.http_addr = ""

    # ---- context manager -------------------------------------------------------------------
    def __enter__(self) -> LocalTrio:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.stop(clean=exc_type is None)

    @property
    def metrics_ports(self) -> dict[str, int]:
        return {p.name: p.metrics_port for p in self.processes if p.metrics_port}

    # ---- start -----------------------------------------------------------------------------
    def start(self) -> None:
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="card-trio-"))
        self.log_dir = Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        redis_url = self.redis_url or self._start_redis()
        self.redis_url = redis_url
        self._start_cache(self.cache_port)
        draft = self.start_draft(self.draft_model, self.draft_quantize, name=self.draft_name,
                                 port=self.draft_port, wait=False)
        target = self._spawn("card-target", self.target_args(),
                             env={"CARD_TARGET_TARGET_TOKEN": self.target_token,
                                  "CARD_TARGET_API_KEY": self.api_key, **tls_env("CARD_TARGET", self.tls)})
        # both load their models at once; wait for each
        self.draft_addr = draft.wait_listening(self.start_timeout_s)
        self.target_addr = target.wait_listening(self.start_timeout_s)
        if self.http_port is not None:
            self.http_addr = target.wait_listening(self.start_timeout_s, HTTP_LISTENING)
        draft.wait_serving(self.start_timeout_s)
        target.wait_serving(self.start_timeout_s)

    def target_args(self) -> list[str]:
        """card-target's command line (its secrets travel in variables): every port explicit, so
        that trios started at once on one machine never fight for a default one."""
        return [
            "--model", self.target_model, "--cache", self.cache_addr, "--port", str(self.target_port),
            "--threads", str(self.target_threads), "--dtype", self.dtype, "--device", self.device,
            "--exact", "on" if self.exact else "off",
            *([] if self.speculation is None else ["--speculation", self.speculation]),
            *(["--no-http"] if self.http_port is None else ["--http-port", str(self.http_port)]),
            *([] if self.http_host is None else ["--http-host", self.http_host]),
            *(f"--served-model-name={name}" for name in self.served_model_names),
            *self.extra_args.get("target", ()),
        ]

    def _start_cache(self, port: int) -> ServiceProcess:
        assert self.redis_url is not None
        cache = self._spawn("card-cache", ["--port", str(port), "--redis-url", self.redis_url,
                                           *self.extra_args.get("cache", ())],
                            env={"CARD_CACHE_DRAFT_TOKEN": self.draft_token,
                                 "CARD_CACHE_TARGET_TOKEN": self.target_token,
                                 "CARD_CACHE_OPERATOR_TOKEN": self.operator_token,
                                 **tls_env("CARD_CACHE", self.tls)})
        self.cache_addr = cache.wait_listening(self.start_timeout_s)
        cache.wait_serving(self.start_timeout_s)
        return cache

    def restart_cache(self) -> ServiceProcess:
        """Replace the cache with a fresh process on the same port (drafts and target reconnect)."""
        for old in [p for p in self.processes if p.name == "card-cache"]:
            old.terminate()
            if old.wait(self.grace_s) is None:
                old.kill()
                old.wait(5)
            self.processes.remove(old)
        return self._start_cache(int(self.cache_addr.rsplit(":", 1)[1]))

    def start_draft(self, model: str, quantize: str = "none", *, name: str | None = None,
                    threads: int | None = None, port: int = 0, args: Sequence[str] = (),
                    wait: bool = True) -> ServiceProcess:
        """Start one more draft worker on this trio's cache (several may run at once)."""
        cmd = ["--cache", self.cache_addr, "--model", model, "--quantize", quantize,
               "--port", str(port), "--threads", str(threads or self.draft_threads),
               "--dtype", self.dtype, "--device", self.device]
        if model == NGRAM:
            cmd += ["--tokenizer", self.target_model]
        elif self.cascade != "none":
            cmd += ["--cascade", self.cascade]
        if self.ngram is not None:
            cmd += ngram_args(self.ngram)
        cmd += [*self.extra_args.get("draft", ()), *args]
        if name:
            cmd += ["--name", name]
        proc = self._spawn("card-draft", cmd, label=f"card-draft-{name or len(self.drafts)}",
                           env={"CARD_DRAFT_DRAFT_TOKEN": self.draft_token,
                                **tls_env("CARD_DRAFT", self.tls)})
        self.drafts.append(proc)
        if wait:
            proc.wait_listening(self.start_timeout_s)
            proc.wait_serving(self.start_timeout_s)
        return proc

    def _spawn(self, script: str, args: list[str], label: str | None = None,
               env: dict[str, str | None] | None = None) -> ServiceProcess:
        """Start ``script``; ``env``: extra variables (None values are left out), the way secrets
        travel (a command line is visible to every local user in ps)."""
        label = label or script
        assert self.log_dir is not None
        log_path = self.log_dir / f"{label}.log"
        n = 1
        while log_path.exists():  # a restarted service keeps its predecessor's log
            n += 1
            log_path = self.log_dir / f"{label}-{n}.log"
        metrics_port = free_port() if self.metrics else 0
        cmd = die_with_parent([console_script(script), *args, "--metrics-port", str(metrics_port)])
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                   **{k: v for k, v in (env or {}).items() if v is not None}}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=environ, start_new_session=True)
        service = ServiceProcess(label, proc, log_path, metrics_port=metrics_port, tls=self.tls)
        self.processes.append(service)
        return service

    def _start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            if self.require_redis:
                raise Unavailable("redis-server is not installed (apt-get install redis-server)")
            warning = ("redis-server not found: the cache keeps its metadata in memory (memory://); "
                       "install redis-server for the real store")
            self.warnings.append(warning)
            print(f"warning: {warning}", file=sys.stderr)
            return "memory://"
        assert self.log_dir is not None
        port = free_port()
        with open(self.log_dir / "redis.log", "wb") as log:
            self.redis = subprocess.Popen(
                die_with_parent([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(self.log_dir)]),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.redis.poll() is not None:
                raise Unavailable(f"redis-server exited with code {self.redis.returncode}; "
                                  f"see {self.log_dir / 'redis.log'}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0"
            time.sleep(0.05)
        raise Unavailable(f"redis-server did not answer on port {port} within 20s")

    # ---- stop ------------------------------------------------------------------------------
    def stop(self, clean: bool = True) -> None:
        """Stop everything: target and drafts first, then the cache, then redis."""
        front = [p for p in self.processes if p.name != "card-cache"]
        back = [p for p in self.processes if p.name == "card-cache"]
        failed = False
        for group in (front, back):
            for p in group:
                p.terminate()
            for p in group:
                if p.wait(self.grace_s) is None:
                    p.kill()
                    p.wait(5)
                    failed = True
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            try:
                self.redis.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                self.redis.kill()
                self.redis.wait(5)
        self.processes.clear()
        self.drafts.clear()
        if self._own_log_dir and clean and not failed and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
