"""Consistency of deploy/: the Kubernetes manifests against the services' real CLIs, and the image.

The manifests are rendered here the way kustomize renders them (resources, components, generated
ConfigMaps, strategic-merge patches, image tags), then checked against the code they run: every
container command is a console script from pyproject.toml, every CARD_* variable is one the
service's click command reads (collected from the imported command objects, so a renamed option
breaks this test), the ports the service will listen on (environment or click default) are the
ports that probes, Services and scrape annotations point at, and every probe is a native gRPC
health probe on the gRPC port. Where kubectl is installed, the Python rendering is compared with
`kubectl kustomize` so the renderer itself cannot drift.

Draft pools: one Deployment per pool (base/draft.yaml is `default`, components/draft-pool-* add
more), each naming its pool in its own env and label, with selectors that keep pools apart and a
grace period that outlasts the worker's drain. The overlays docs/deploy.md shows (blocks opening
with ``# my-overlay/kustomization.yaml``) are rendered and checked like the shipped ones.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import click
import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

from tests.metric_names import exported_metrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
OVERLAYS = {"cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu",
            "hardened": K8S / "overlays" / "hardened"}
CACHE_GPU = K8S / "components" / "cache-gpu"
TLS = K8S / "components" / "tls"
HARDENED = K8S / "components" / "hardened"
PODMONITOR = K8S / "components" / "podmonitor"
KEDA = K8S / "components" / "autoscale-keda"
POOL_COMPONENT = K8S / "components" / "draft-pool-qwen-05b-int8"
POOL_LABEL = "card.ai/pool"
DOCS = ROOT / "docs" / "deploy.md"
IMAGE = "card-serving"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
VERSION: str = PYPROJECT["project"]["version"]
SERVICE_SCRIPTS = ("card-cache", "card-target", "card-draft")
# Read by the engine itself (engine/loading/embedded.py, gguf_cache.py), not by a click option.
ENGINE_ENVVARS = frozenset({"CARD_MODELS_DIR", "CARD_DEFAULT_MODEL_FIND_LINKS", "CARD_GGUF_CACHE"})
KUSTOMIZATION_KEYS = frozenset(
    {"apiVersion", "kind", "resources", "components", "configMapGenerator", "patches", "images"}
)
BIND_ALL = ("0.0.0.0", "::", "[::]")


# ---- a small kustomize ----------------------------------------------------------------------
@dataclass
class Rendered:
    objects: list[dict]
    generated: dict[str, dict[str, str]] = field(default_factory=dict)  # ConfigMap name -> data

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
        return found[0]


def load_yaml(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def strategic_merge(base: object, patch: object) -> object:
    """Strategic merge as kustomize applies it to the fields used here: maps merge, ``null``
    deletes, lists of named maps (containers, env, volumes) merge by name, other lists replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list)
            and all(isinstance(i, dict) and "name" in i for i in [*base, *patch])):
        out = [copy.deepcopy(i) for i in base]
        for item in patch:
            idx = next((n for n, b in enumerate(out) if b["name"] == item["name"]), None)
            if idx is None:
                out.append(copy.deepcopy(item))
            else:
                out[idx] = strategic_merge(out[idx], item)
        return out
    return copy.deepcopy(patch)


def _literals(gen: dict) -> dict[str, str]:
    data = {}
    for literal in gen.get("literals", []):
        assert isinstance(literal, str), f"literal {literal!r} is not a string (quote it in YAML)"
        key, sep, value = literal.partition("=")
        assert sep, f"literal {literal!r} has no '='"
        data[key] = value
    return data


def render(directory: Path, components: tuple[Path, ...] = ()) -> Rendered:
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out = Rendered(objects=[])
    for ref in kust.get("resources", []):
        path = (directory / ref).resolve()
        if path.is_dir():
            sub = render(path)
            out.objects += sub.objects
            out.generated.update(sub.generated)
        else:
            out.objects += load_yaml(path)
    for comp in [*(directory / c for c in kust.get("components", [])), *components]:
        _transform(out, comp.resolve(), yaml.safe_load((comp / "kustomization.yaml").read_text()))
    _transform(out, directory, kust)
    return out


def _transform(out: Rendered, directory: Path, kust: dict) -> None:
    unknown = set(kust) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: fields this test cannot render: {sorted(unknown)}"
    if kust.get("kind") == "Component":  # a component's resources join where it is applied
        for ref in kust.get("resources", []):
            assert (directory / ref).is_file(), f"{directory}: component resource {ref} is not a file"
            out.objects += load_yaml(directory / ref)
    for gen in kust.get("configMapGenerator", []):
        behavior = gen.get("behavior", "create")
        name, data = gen["name"], _literals(gen)
        assert set(gen) <= {"name", "behavior", "literals"}, f"{directory}: unsupported generator {gen}"
        if behavior == "create":
            assert name not in out.generated, f"{directory}: ConfigMap {name} created twice"
            out.generated[name] = data
        else:
            assert name in out.generated, f"{directory}: {behavior} of unknown ConfigMap {name}"
            out.generated[name] = {**out.generated[name], **data} if behavior == "merge" else data
    for patch in kust.get("patches", []):
        assert set(patch) <= {"path", "patch", "target"} and len({"path", "patch"} & set(patch)) == 1, (
            f"{directory}: a patch is a file or inline text, with an optional target: {patch}")
        docs = (load_yaml(directory / patch["path"]) if "path" in patch
                else [d for d in yaml.safe_load_all(patch["patch"]) if d is not None])
        for doc in docs:
            for target in _patch_targets(out, doc, patch.get("target")):
                if doc.get("$patch") == "delete":
                    out.objects.remove(target)
                    continue
                # with a target, the patch's own name is ignored (it applies to each selected object)
                doc = {**doc, "metadata": {**doc["metadata"], "name": target["metadata"]["name"]}}
                out.objects[out.objects.index(target)] = strategic_merge(target, doc)
    for image in kust.get("images", []):
        for container in _all_containers(out.objects):
            if container["image"].split(":")[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    # generated ConfigMaps join the output last (kustomize lists them first; order is irrelevant)
    out.objects = [o for o in out.objects if not o.get("_generated")]
    out.objects += [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": n}, "data": d, "_generated": True}
        for n, d in out.generated.items()
    ]


def _patch_targets(out: Rendered, doc: dict, target: dict | None) -> list[dict]:
    """The objects a strategic-merge patch applies to: the one its kind and name say, or every
    object its ``target`` selects (kind, name, labelSelector of ``key=value`` terms)."""
    if target is None:
        return [out.get(doc["kind"], doc["metadata"]["name"])]
    assert set(target) <= {"kind", "name", "labelSelector"}, f"target fields not rendered here: {target}"
    terms = [t.partition("=") for t in target.get("labelSelector", "").split(",") if t]
    assert all(sep == "=" and "!" not in k for k, sep, _ in terms), f"equality terms only: {target}"
    return [o for o in out.objects if not o.get("_generated")
            and o["kind"] == target.get("kind", o["kind"])
            and o["metadata"]["name"] == target.get("name", o["metadata"]["name"])
            and all(o["metadata"].get("labels", {}).get(k) == v for k, _, v in terms)]


def _all_containers(objects: list[dict]) -> Iterator[dict]:
    for obj in objects:
        if obj["kind"] == "Deployment":
            yield from obj["spec"]["template"]["spec"]["containers"]


@dataclass(frozen=True)
class Variant:
    """An overlay as an operator writes one: resources, then components in order, then fields of
    its own (a ConfigMap merge, patches)."""

    resources: tuple[Path, ...]
    components: tuple[Path, ...] = ()
    extra: dict = field(default_factory=dict)

    def write(self, at: Path) -> Path:
        """This overlay's kustomization.yaml in ``at`` (paths relative: kustomize refuses absolute
        ones)."""
        at.mkdir(parents=True, exist_ok=True)
        rel = lambda p: os.path.relpath(p, at)  # noqa: E731
        kust = {"resources": [rel(p) for p in self.resources],
                "components": [rel(p) for p in self.components], **self.extra}
        (at / "kustomization.yaml").write_text(yaml.safe_dump(kust, sort_keys=False))
        return at


DOCS_OVERLAY = "# my-overlay/kustomization.yaml"
DOCS_K8S = "../../deploy/k8s/"  # the docs' overlays sit two folders below a checkout's parent


def docs_overlays() -> dict[str, Variant]:
    """The overlays docs/deploy.md shows in full (a block opening with DOCS_OVERLAY), in order; a
    block whose first line adds "(added)" sets its fields over those of the overlay before it."""
    found: dict[str, Variant] = {}
    previous: dict | None = None
    blocks = re.findall(r"^```yaml\n(" + re.escape(DOCS_OVERLAY) + r".*?)^```", DOCS.read_text(), re.M | re.S)
    for n, block in enumerate(blocks, 1):
        kust = yaml.safe_load(block)
        if "(added)" in block.splitlines()[0]:
            assert previous is not None, "an (added) block follows a whole overlay"
            kust = {**previous, **kust}
        previous = kust
        refs = {k: kust.get(k, []) for k in ("resources", "components")}
        assert all(r.startswith(DOCS_K8S) for r in [*refs["resources"], *refs["components"]]), (
            f"docs overlay #{n}: paths start {DOCS_K8S}")
        paths = {k: tuple(K8S / r.removeprefix(DOCS_K8S) for r in v) for k, v in refs.items()}
        extra = {k: v for k, v in kust.items() if k not in refs}
        found[f"docs#{n}"] = Variant(paths["resources"], paths["components"], extra)
    return found


VARIANTS: dict[str, Variant] = {
    "base": Variant((BASE,)),
    "cpu": Variant((OVERLAYS["cpu"],)),
    "gpu": Variant((OVERLAYS["gpu"],)),
    "gpu+cache-gpu": Variant((OVERLAYS["gpu"],), (CACHE_GPU,)),
    "cpu+tls": Variant((OVERLAYS["cpu"],), (TLS,)),
    "cpu+pool": Variant((OVERLAYS["cpu"],), (POOL_COMPONENT,)),
    "gpu+pool": Variant((OVERLAYS["gpu"],), (POOL_COMPONENT,)),
    "gpu+pool+tls": Variant((OVERLAYS["gpu"],), (POOL_COMPONENT, TLS)),
    "hardened": Variant((OVERLAYS["hardened"],)),
    "gpu+pool+tls+hardened": Variant((OVERLAYS["gpu"],), (POOL_COMPONENT, TLS, HARDENED)),
    "cpu+pool+podmonitor+keda": Variant((OVERLAYS["cpu"],), (POOL_COMPONENT, PODMONITOR, KEDA)),
    **docs_overlays(),
}


def render_variant(name: str, at: Path) -> Rendered:
    return render(VARIANTS[name].write(at))


@pytest.fixture(params=list(VARIANTS), scope="module")
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Rendered]:
    at = tmp_path_factory.mktemp(re.sub(r"\W+", "-", request.param))
    return request.param, render_variant(request.param, at)


# ---- the services' real command-line interfaces ---------------------------------------------
def command_for(script: str) -> click.Command:
    """The click command behind a console script; an import error fails the test."""
    module_name, _, attr = SCRIPTS[script].partition(":")
    command = getattr(importlib.import_module(module_name), attr)
    assert isinstance(command, click.Command), f"{SCRIPTS[script]} is not a click command"
    return command


def envvars_of(param: click.Parameter, command: click.Command) -> list[str]:
    if param.envvar:
        return [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
    prefix = (command.context_settings or {}).get("auto_envvar_prefix")
    if prefix and isinstance(param, click.Option) and param.allow_from_autoenv and param.name:
        return [f"{prefix}_{param.name.upper()}"]
    return []


def accepted_envvars(command: click.Command) -> set[str]:
    return {name for p in command.params for name in envvars_of(p, command)}


def effective(command: click.Command, env: dict[str, str], flag: str) -> str:
    """What the service will use for option ``flag`` (the CLI contract names flags, not Python
    parameter names) given this environment: the variable when set, else the click default."""
    params = [p for p in command.params if flag in getattr(p, "opts", ())]
    assert params, f"{command.name} has no option {flag}"
    param = params[0]
    for name in envvars_of(param, command):
        if name in env:
            return env[name]
    default = param.default() if callable(param.default) else param.default
    return str(default)


@dataclass
class CardContainer:
    deployment: dict
    container: dict
    script: str
    env: dict[str, str]  # envFrom ConfigMaps, then explicit env (which wins, as in Kubernetes)

    @property
    def pod(self) -> dict:
        return self.deployment["spec"]["template"]

    def port(self, name: str) -> int:
        ports = [p["containerPort"] for p in self.container.get("ports", []) if p.get("name") == name]
        assert len(ports) == 1, f"{self.script}: needs exactly one container port named {name!r}"
        return ports[0]


def configmap_env(rendered: Rendered, container: dict) -> dict[str, str]:
    """The variables a container's ConfigMaps give it (what is left where an optional Secret is absent)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(rendered.get("ConfigMap", source["configMapRef"]["name"])["data"])
    return env


def card_containers(rendered: Rendered) -> list[CardContainer]:
    found = []
    for dep in rendered.of_kind("Deployment"):
        for container in dep["spec"]["template"]["spec"]["containers"]:
            if container["image"].split(":")[0] != IMAGE:
                continue
            env: dict[str, str] = {}
            for source in container.get("envFrom", []):
                env.update(rendered.get("ConfigMap", source["configMapRef"]["name"])["data"])
            for var in container.get("env", []):
                # values from the downward API are known only at run time; mark them as set
                env[var["name"]] = var.get("value", "<from " + ",".join(var.get("valueFrom", {})) + ">")
            found.append(CardContainer(dep, container, container["command"][0], env))
    return found


# ---- static structure -----------------------------------------------------------------------
def all_yaml() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


@pytest.mark.parametrize("path", all_yaml(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_yaml_file_parses_into_kubernetes_objects(path: Path) -> None:
    docs = load_yaml(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert {"apiVersion", "kind"} <= set(doc), f"{path}: a document without apiVersion/kind"
        if path.name != "kustomization.yaml":
            assert doc["metadata"]["name"], f"{path}: unnamed object"
            assert "namespace" not in doc["metadata"], f"{path}: manifests must be namespace-agnostic"


def test_kustomizations_reference_existing_files_and_nothing_is_orphaned() -> None:
    kustomizations = sorted(K8S.rglob("kustomization.yaml"))
    assert {p.parent for p in kustomizations} >= {BASE, CACHE_GPU, TLS, HARDENED, PODMONITOR, KEDA,
                                                  POOL_COMPONENT, *OVERLAYS.values()}
    referenced: set[Path] = set()
    for kfile in kustomizations:
        kust = yaml.safe_load(kfile.read_text())
        expected_kind = "Component" if kfile.parent.parent.name == "components" else "Kustomization"
        assert kust["kind"] == expected_kind, kfile
        for ref in [*kust.get("resources", []), *kust.get("components", []),
                    *(p["path"] for p in kust.get("patches", []) if "path" in p)]:
            path = (kfile.parent / ref).resolve()
            assert path.exists(), f"{kfile}: {ref} does not exist"
            if path.is_dir():
                assert (path / "kustomization.yaml").exists(), f"{kfile}: {ref} has no kustomization.yaml"
            referenced.add(path)
    orphans = [p for p in all_yaml() if p.name != "kustomization.yaml" and p.resolve() not in referenced]
    assert not orphans, f"YAML files no kustomization uses: {orphans}"


# ---- rendered manifests ---------------------------------------------------------------------
def test_every_service_runs_once_and_each_command_is_an_entry_point(variant: tuple[str, Rendered]) -> None:
    """One cache, one target; drafts once per pool (one Deployment each)."""
    _, rendered = variant
    containers = card_containers(rendered)
    scripts = [c.script for c in containers]
    assert sorted(set(scripts)) == sorted(SERVICE_SCRIPTS)
    assert scripts.count("card-cache") == scripts.count("card-target") == 1
    for c in containers:
        assert c.script in SCRIPTS, f"{c.script} is not a [project.scripts] entry point"
        assert len(c.container["command"]) == 1, "flags go in args (or, preferably, the ConfigMap)"
        command = command_for(c.script)
        options = {opt for p in command.params for opt in getattr(p, "opts", [])}
        for arg in c.container.get("args", []):
            if arg.startswith("--"):
                assert arg.split("=")[0] in options, f"{c.script} has no option {arg}"


def _all_params(command: click.Command) -> list[tuple[click.Command, click.Parameter]]:
    subcommands = getattr(command, "commands", {}).values()
    return [(command, p) for p in command.params] + [pair for sub in subcommands for pair in _all_params(sub)]


@pytest.mark.parametrize("script", [*SERVICE_SCRIPTS, "card-client", "card-bench"])
def test_every_option_reads_card_service_option(script: str) -> None:
    """One naming rule: an option of card-X reads CARD_X_<OPTION> and --help says so; every option
    of a service has one (the manifests configure services by variables alone)."""
    import card.client.cli

    command = card.client.cli.cli if script == "card-client" else command_for(script)
    prefix = "CARD_" + script.removeprefix("card-").upper() + "_"
    for cmd, param in _all_params(command):
        if not isinstance(param, click.Option):
            continue
        names = envvars_of(param, cmd)
        assert all(n.startswith(prefix) for n in names), (script, param.name, names)
        assert param.show_envvar or not names, (script, param.name)
        assert names or script not in SERVICE_SCRIPTS, (script, param.name)


def test_every_card_variable_is_read_by_its_service(variant: tuple[str, Rendered]) -> None:
    _, rendered = variant
    for c in card_containers(rendered):
        for source in c.container.get("envFrom", []):
            keys = rendered.get("ConfigMap", source["configMapRef"]["name"])["data"]
            # e.g. a literal split by a YAML flow sequence's comma: `[A=x=1,y=2]` is two literals
            stray = sorted(k for k in keys if not re.fullmatch(r"CARD_[A-Z0-9_]+", k))
            assert not stray, f"{c.script}: {source['configMapRef']['name']} has keys {stray}"
        accepted = accepted_envvars(command_for(c.script)) | ENGINE_ENVVARS
        unknown = sorted(k for k in c.env if k.startswith("CARD_") and k not in accepted)
        assert not unknown, f"{c.script} does not read {unknown}; it reads {sorted(accepted)}"


def test_probes_are_grpc_health_checks_on_the_plaintext_health_port(variant: tuple[str, Rendered]) -> None:
    """The kubelet's gRPC probe cannot speak TLS: probes ask the plaintext health port, which
    every service serves beside its gRPC port (which components/tls turns to TLS)."""
    _, rendered = variant
    for c in card_containers(rendered):
        grpc_port, health_port = c.port("grpc"), c.port("health")
        assert effective(command_for(c.script), c.env, "--port") == str(grpc_port), (
            f"{c.script} listens on another port than its container port 'grpc' ({grpc_port})")
        assert effective(command_for(c.script), c.env, "--health-port") == str(health_port), c.script
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.container.get(kind)
            assert probe, f"{c.script}: no {kind}"
            handlers = {"grpc", "exec", "httpGet", "tcpSocket"} & set(probe)
            if c.script == "card-target" and kind == "readinessProbe":
                # ready = the OpenAI-compatible front's /health, on the port card-target serves it
                http = c.port("http")
                assert effective(command_for(c.script), c.env, "--http-port") == str(http)
                assert effective(command_for(c.script), c.env, "--http-host") == "0.0.0.0"
                assert probe["httpGet"]["path"] == "/health" and probe["httpGet"]["port"] in ("http", http)
                continue
            assert handlers == {"grpc"}, f"{c.script} {kind}: must be a grpc probe, has {handlers}"
            # Kubernetes' grpc probe takes a number only, so it is checked against the named port.
            assert probe["grpc"] == {"port": health_port, "service": ""}, f"{c.script} {kind}"


@pytest.mark.parametrize("components", [(TLS,), (POOL_COMPONENT, TLS)], ids=["tls", "pool+tls"])
def test_tls_component_gives_every_service_its_certificate_and_the_cache_mutual_tls(
        components: tuple[Path, ...]) -> None:
    """Every draft pool's pods too: the drafts' mounts are patched by label, not by name."""
    plain = {c.script: c for c in card_containers(render(OVERLAYS["cpu"]))}
    assert not any(k.startswith(f"CARD_{s}_TLS") for c in plain.values() for k in c.env
                   for s in ("CACHE", "TARGET", "DRAFT"))
    rendered = render(OVERLAYS["cpu"], components=components)
    drafts = [c for c in card_containers(rendered) if c.script == "card-draft"]
    assert len(drafts) == len(components)
    for c in card_containers(rendered):
        command = command_for(c.script)
        files = {flag: effective(command, c.env, flag) for flag in ("--tls-cert", "--tls-key", "--tls-ca")}
        mounts = {m["mountPath"]: m for m in c.container["volumeMounts"]}
        volumes = {v["name"]: v for v in c.pod["spec"]["volumes"]}
        for flag, path in files.items():
            mount = mounts.get(str(Path(path).parent))
            assert mount and mount["readOnly"], f"{c.script} {flag} {path}: not on a read-only mount"
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == c.script + "-tls", c.script
            assert Path(path).name in ("tls.crt", "tls.key", "ca.crt"), f"{flag}: not a cert-manager key"
    by_script = {c.script: c for c in card_containers(rendered)}
    assert effective(command_for("card-cache"), by_script["card-cache"].env, "--tls-client-auth") == "true"
    assert "CARD_TARGET_TLS_CLIENT_AUTH" not in by_script["card-target"].env  # users need no certificate


def test_tls_component_serves_the_targets_http_port_as_https_too() -> None:
    """Both ports the target's Service exposes carry TLS with the component: the HTTP front serves
    the same certificate (--http-tls-cert/--http-tls-key), its readiness probe and Service say HTTPS."""
    command = command_for("card-target")
    plain = next(c for c in card_containers(render(OVERLAYS["cpu"])) if c.script == "card-target")
    assert effective(command, plain.env, "--http-tls-cert") == "None"
    assert plain.container["readinessProbe"]["httpGet"].get("scheme", "HTTP") == "HTTP"
    rendered = render(OVERLAYS["cpu"], components=(TLS,))
    target = next(c for c in card_containers(rendered) if c.script == "card-target")
    for http_flag, grpc_flag in (("--http-tls-cert", "--tls-cert"), ("--http-tls-key", "--tls-key")):
        assert effective(command, target.env, http_flag) == effective(command, target.env, grpc_flag)
    assert target.container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    ports = {p["name"]: p for p in rendered.get("Service", "card-target")["spec"]["ports"]}
    assert ports["http"]["appProtocol"] == "https" and ports["http"]["targetPort"] == "http"
    assert ports["grpc"]["appProtocol"] == "grpc"


@pytest.mark.parametrize("name", ["hardened", "gpu+pool+tls+hardened"])
def test_hardened_requires_every_secret_and_opens_no_internet(name: str, tmp_path: Path) -> None:
    """components/hardened: every credential a service reads from a Secret is required (a missing
    Secret stops the pod instead of letting it serve open), TLS is on, the Hub is out of reach and
    said to be (HF_HUB_OFFLINE); the same manifests without it keep every Secret optional."""
    rendered = render_variant(name, tmp_path)
    plain = render_variant(name.replace("+hardened", "").replace("hardened", "cpu+tls"), tmp_path / "plain")
    for variant_, required in ((rendered, True), (plain, False)):
        # the Hub token is for downloads, which the hardened overlay does not make
        containers = [(d["metadata"]["name"], c) for d in variant_.of_kind("Deployment")
                      for c in d["spec"]["template"]["spec"]["containers"]]
        refs = [(who, v["name"], v["valueFrom"]["secretKeyRef"]) for who, c in containers
                for v in c.get("env", []) if "secretKeyRef" in v.get("valueFrom", {})
                and v["name"] != "HF_TOKEN"]
        assert {n for n, _, _ in refs} >= {"card-cache", "card-target", "card-draft", "card-redis"}
        assert {v for _, v, _ in refs} >= {"CARD_CACHE_OPERATOR_TOKEN", "CARD_CACHE_REDIS_URL",
                                           "REDIS_PASSWORD"}
        assert is_hardened(variant_) is required
        for who, var, ref in refs:
            assert ref.get("optional", False) is (not required), (who, var, ref)
    drafts = [c for c in card_containers(rendered) if c.script == "card-draft"]
    assert len(drafts) == (2 if "pool" in name else 1)
    for c in card_containers(rendered):
        if c.script != "card-cache":
            assert c.env.get("HF_HUB_OFFLINE") == "1", c.script
        assert c.env.get(f"CARD_{c.script.removeprefix('card-').upper()}_TLS_CERT"), c.script
    assert "card-model-download" not in {p["metadata"]["name"] for p in rendered.of_kind("NetworkPolicy")}


def _selects(selector: dict, dep: dict) -> bool:
    return selector["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_disruption_budgets_keep_a_worker_per_pool_and_the_cache_in_place(
        variant: tuple[str, Rendered]) -> None:
    """A node drain takes one worker of each pool at a time (each drains itself), never the cache
    without an operator, one target at a time; every budget selects pods that exist."""
    _, rendered = variant
    budgets = rendered.of_kind("PodDisruptionBudget")
    deployments = rendered.of_kind("Deployment")
    for pdb in budgets:
        assert any(_selects(pdb["spec"]["selector"], d) for d in deployments), pdb["metadata"]["name"]
    for dep in deployments:
        name = dep["metadata"]["name"]
        mine = [p for p in budgets if _selects(p["spec"]["selector"], dep)]
        if name == "card-redis":
            assert not mine
            continue
        assert len(mine) == 1, f"{name}: {len(mine)} budgets"
        want = 0 if name == "card-cache" else 1
        assert mine[0]["spec"] == {**mine[0]["spec"], "maxUnavailable": want}, name
        # a pool's budget selects that pool alone (a drain of one pool never counts another's pods)
        others = [d for d in deployments if d is not dep and _selects(mine[0]["spec"]["selector"], d)]
        assert not others, f"{name}'s budget also selects {[d['metadata']['name'] for d in others]}"


def test_the_target_keeps_serving_while_endpoints_forget_it(variant: tuple[str, Rendered]) -> None:
    """preStop pauses before SIGTERM (endpoint propagation), and the pause plus the target's own
    shutdown grace fit in the pod's grace period, so the kubelet never kills a finishing target."""
    _, rendered = variant
    target = next(c for c in card_containers(rendered) if c.script == "card-target")
    command = target.container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2
    pause = int(command[1])
    grace = float(effective(command_for("card-target"), target.env, "--shutdown-grace-s"))
    assert pause >= 5 and pause + grace < target.pod["spec"]["terminationGracePeriodSeconds"]


def test_monitoring_components_name_what_the_services_export(tmp_path: Path) -> None:
    """components/podmonitor scrapes the `metrics` port every card pod has; every metric
    components/autoscale-keda's queries read is one a service exports, and each ScaledObject scales
    a Deployment that exists (a renamed metric or Deployment fails here, not silently in KEDA)."""
    rendered = render_variant("cpu+pool+podmonitor+keda", tmp_path)
    (monitor,) = rendered.of_kind("PodMonitor")
    ports = {p["port"] for p in monitor["spec"]["podMetricsEndpoints"]}
    for c in card_containers(rendered):
        assert _selects(monitor["spec"]["selector"], c.deployment)
        assert all(c.port(p) for p in ports), c.script
    exported = exported_metrics()
    scaled = rendered.of_kind("ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == {"card-target", "card-draft"}
    names = {d["metadata"]["name"] for d in rendered.of_kind("Deployment")}
    for obj in scaled:
        assert obj["spec"]["scaleTargetRef"]["name"] in names
        for trigger in obj["spec"]["triggers"]:
            used = set(re.findall(r"\b(card_[a-z_]+)", trigger["metadata"]["query"]))
            assert used and used <= exported, f"{obj['metadata']['name']}: {used - exported} not exported"
    assert "card_nonexistent_metric" not in exported  # the check can fail


def test_the_api_key_guards_every_port_the_targets_service_exposes(variant: tuple[str, Rendered]) -> None:
    """Users reach the target's Service on gRPC and HTTP; card-target checks --api-key on both, so
    the key (from its Secret) is all it takes, and the Service exposes nothing else (metrics and
    health stay on the pod's own ports; /metrics is off on the HTTP port)."""
    _, rendered = variant
    target = next(c for c in card_containers(rendered) if c.script == "card-target")
    key = next(v for v in target.container["env"] if v["name"] == "CARD_TARGET_API_KEY")
    assert key["valueFrom"]["secretKeyRef"]["name"] == "card-target-api-key"
    assert "CARD_TARGET_API_KEY" in accepted_envvars(command_for("card-target"))
    exposed = {p["targetPort"] for p in rendered.get("Service", "card-target")["spec"]["ports"]}
    assert exposed == {"grpc", "http"}
    assert effective(command_for("card-target"), target.env, "--http-metrics").lower() in ("false", "0")


# ---- network policy, evaluated ----------------------------------------------------------------
NAMESPACE = "card"  # where the manifests are applied; a policy's bare podSelector means this one


@dataclass(frozen=True)
class Endpoint:
    """A pod (or an address outside the cluster) as NetworkPolicy sees it."""

    name: str
    namespace: str
    labels: tuple[tuple[str, str], ...] = ()
    ports: tuple[tuple[str, int], ...] = ()  # (name, number) of its container ports
    ip: str = "10.1.0.1"  # pod addresses sit in a private range (as a cluster's do)
    in_cluster: bool = True

    def port(self, port: str | int) -> int:
        if isinstance(port, int):
            return port
        return dict(self.ports)[port]


def _matches(selector: dict | None, labels: dict[str, str]) -> bool:
    assert set(selector or {}) <= {"matchLabels"}, f"selector fields not evaluated here: {selector}"
    return (selector or {}).get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict, who: Endpoint) -> bool:
    if "ipBlock" in peer:
        import ipaddress

        block = peer["ipBlock"]
        addr = ipaddress.ip_address(who.ip)
        return (addr in ipaddress.ip_network(block["cidr"])
                and not any(addr in ipaddress.ip_network(e) for e in block.get("except", [])))
    if not who.in_cluster:
        return False
    ns_labels = {"kubernetes.io/metadata.name": who.namespace}
    ns_ok = (_matches(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer
             else who.namespace == NAMESPACE)
    return ns_ok and _matches(peer.get("podSelector"), dict(who.labels))


def _port_matches(rule: dict, dst: Endpoint, port: int, protocol: str) -> bool:
    if "ports" not in rule:
        return True
    for p in rule["ports"]:
        if p.get("protocol", "TCP") != protocol:
            continue
        named = p["port"]
        if isinstance(named, str):
            if dict(dst.ports).get(named) == port:
                return True
        elif named == port:
            return True
    return False


def policy_allows(policies: list[dict], src: Endpoint, dst: Endpoint, port: str | int,
                  protocol: str = "TCP") -> bool:
    """Whether a connection from ``src`` to ``dst``'s ``port`` is allowed: the egress policies that
    select ``src`` and the ingress policies that select ``dst`` must each allow it (a pod no policy
    of a direction selects is open in that direction), as the NetworkPolicy API defines."""
    number = dst.port(port)

    def side(direction: str, pod: Endpoint, peer: Endpoint) -> bool:
        if not pod.in_cluster or pod.namespace != NAMESPACE:
            return True  # outside the manifests: no policy of ours applies
        chosen = [p for p in policies if direction in p["spec"]["policyTypes"]
                  and _matches(p["spec"]["podSelector"], dict(pod.labels))]
        if not chosen:
            return True
        key, peers = ("egress", "to") if direction == "Egress" else ("ingress", "from")
        return any(_port_matches(rule, dst, number, protocol)
                   and (peers not in rule or any(_peer_matches(x, peer) for x in rule[peers]))
                   for p in chosen for rule in p["spec"].get(key, []))

    return side("Egress", src, dst) and side("Ingress", dst, src)


def pods_of(rendered: Rendered) -> dict[str, Endpoint]:
    out = {}
    for dep in rendered.of_kind("Deployment"):
        template = dep["spec"]["template"]
        ports = tuple((p["name"], p["containerPort"]) for c in template["spec"]["containers"]
                      for p in c.get("ports", []) if "name" in p)
        out[dep["metadata"]["name"]] = Endpoint(dep["metadata"]["name"], NAMESPACE,
                                                tuple(template["metadata"]["labels"].items()), ports)
    return out


USER = Endpoint("user", "somewhere-else", (("app", "anything"),))
PROMETHEUS = Endpoint("prometheus", "monitoring", (("app", "prometheus"),))
NEIGHBOUR = Endpoint("neighbour", NAMESPACE, (("app", "neighbour"),))  # another app in the namespace
KUBE_DNS = Endpoint("kube-dns", "kube-system", (("k8s-app", "kube-dns"),), (("dns", 53),))
HUB = Endpoint("huggingface.co", "", ip="18.239.50.80", in_cluster=False)


def test_network_policies_deny_by_default_and_allow_only_the_services_links(
        variant: tuple[str, Rendered]) -> None:
    """Evaluated as the NetworkPolicy API defines it: users reach only the target's two ports; the
    cache's gRPC port only targets and drafts; Redis only the cache; a draft (which sees every prompt
    and output) reaches the cache and DNS and nothing else; metrics only the monitoring namespace;
    the internet only pods labelled as downloading a Hub model, never a pod through that rule."""
    _, rendered = variant
    policies = rendered.of_kind("NetworkPolicy")
    pods = pods_of(rendered)
    target, cache, redis = pods["card-target"], pods["card-cache"], pods["card-redis"]
    drafts = [p for p in pods.values() if dict(p.labels).get("app.kubernetes.io/component") == "draft"]
    assert drafts
    allowed = functools.partial(policy_allows, policies)
    for pod in pods.values():  # every pod of ours is default-deny in both directions
        chosen = [p for p in policies if _matches(p["spec"]["podSelector"], dict(pod.labels))]
        assert {t for p in chosen for t in p["spec"]["policyTypes"]} == {"Ingress", "Egress"}, pod.name
        assert allowed(pod, KUBE_DNS, 53, "UDP") and allowed(pod, KUBE_DNS, 53, "TCP"), pod.name
        named = dict(pod.ports)
        if "health" in named:  # probes come from the pod's node, which no policy can block
            assert not allowed(NEIGHBOUR, pod, "health") and not allowed(USER, pod, "health"), pod.name
        if "metrics" in named:
            assert allowed(PROMETHEUS, pod, "metrics"), pod.name
            assert not allowed(USER, pod, "metrics") and not allowed(NEIGHBOUR, pod, "metrics"), pod.name
            assert allowed(PROMETHEUS, pod, "grpc") == (pod is target), pod.name  # the front door
        downloads = any(p["metadata"]["name"] == "card-model-download" for p in policies)  # hardened: none
        hub = dict(pod.labels).get("card.ai/model-source") == "hub" and downloads
        assert allowed(pod, HUB, 443) == hub, pod.name
        for other in pods.values():  # the download rule opens the internet, not the cluster
            for port_name, _ in other.ports:
                ok = ((pod is target and other is cache and port_name == "grpc")
                      or (pod in drafts and other is cache and port_name == "grpc")
                      or (pod is cache and other is redis and port_name == "redis"))
                assert allowed(pod, other, port_name) == ok, (pod.name, other.name, port_name)
    for port_name in ("grpc", "http"):
        assert allowed(USER, target, port_name) and allowed(NEIGHBOUR, target, port_name)
    for pod in (cache, redis, *drafts):
        for port_name, _ in pod.ports:
            assert not allowed(USER, pod, port_name), (pod.name, port_name)
    assert any(dict(p.labels).get("card.ai/model-source") == "hub" for p in pods.values()) == (
        any(c.env.get("CARD_TARGET_MODEL", c.env.get("CARD_DRAFT_MODEL", "default")) != "default"
            for c in card_containers(rendered) if c.script != "card-cache")), (
        "a pod whose model is a Hub id carries card.ai/model-source=hub (and only such a pod)")


def test_the_policy_evaluator_sees_an_open_door() -> None:
    """Negative control: a policy that lets the namespace reach the cache, or a draft reach
    anything, is caught by the same evaluation."""
    rendered = render(OVERLAYS["cpu"])
    pods = pods_of(rendered)
    policies = rendered.of_kind("NetworkPolicy")
    assert not policy_allows(policies, NEIGHBOUR, pods["card-cache"], "grpc")
    assert not policy_allows(policies, pods["card-draft"], HUB, 443)
    leaky = copy.deepcopy(policies)
    cache_policy = next(p for p in leaky if p["metadata"]["name"] == "card-cache")
    cache_policy["spec"]["ingress"].append({"ports": [{"port": "grpc"}]})
    draft_policy = next(p for p in leaky if p["metadata"]["name"] == "card-draft")
    draft_policy["spec"]["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})
    assert policy_allows(leaky, NEIGHBOUR, pods["card-cache"], "grpc")
    assert policy_allows(leaky, pods["card-draft"], HUB, 443)


def test_metrics_port_matches_container_port_and_scrape_annotations(variant: tuple[str, Rendered]) -> None:
    _, rendered = variant
    for c in card_containers(rendered):
        metrics = c.port("metrics")
        assert effective(command_for(c.script), c.env, "--metrics-port") == str(metrics), c.script
        # loopback by default (a service run by hand exposes nothing); the pod's IP in the cluster
        assert effective(command_for(c.script), {}, "--metrics-host") == "127.0.0.1", c.script
        assert effective(command_for(c.script), c.env, "--metrics-host") == "0.0.0.0", c.script
        annotations = c.pod["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", c.script
        assert annotations.get("prometheus.io/port") == str(metrics), c.script
        assert annotations.get("prometheus.io/path") == "/metrics", c.script


def test_services_select_one_deployment_and_target_existing_ports(variant: tuple[str, Rendered]) -> None:
    _, rendered = variant
    for svc in rendered.of_kind("Service"):
        selector = svc["spec"]["selector"]
        matches = [d for d in rendered.of_kind("Deployment")
                   if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {svc['metadata']['name']} selects {len(matches)} Deployments"
        dep = matches[0]
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"][
            "labels"].items()
        ports = [p for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
        for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            assert any(target in (p.get("name"), p["containerPort"]) for p in ports), (
                f"Service {svc['metadata']['name']} targets {target!r}, not a container port")


def service_address(rendered: Rendered, host: str, port: int) -> dict:
    """The in-namespace Service that ``host:port`` names (short or cluster-local DNS name)."""
    name = host.split(".")[0]
    svc = rendered.get("Service", name)
    assert port in [p["port"] for p in svc["spec"]["ports"]], f"Service {name} has no port {port}"
    return svc


def test_addresses_point_at_services_that_reach_the_right_process(variant: tuple[str, Rendered]) -> None:
    _, rendered = variant
    by_script = {c.script: c for c in card_containers(rendered)}
    cache = by_script["card-cache"]
    cache_cmd = command_for("card-cache")
    assert effective(cache_cmd, cache.env, "--host") in BIND_ALL, "the cache must listen on all interfaces"
    url = effective(cache_cmd, cache.env, "--redis-url")
    if url.startswith("<from"):  # the Secret's (with the password; the operator's), else the ConfigMap's
        url = effective(cache_cmd, configmap_env(rendered, cache.container), "--redis-url")
    redis_url = urlsplit(url)
    assert redis_url.scheme == "redis" and redis_url.hostname and redis_url.port
    redis = service_address(rendered, redis_url.hostname, redis_url.port)
    assert redis["spec"]["selector"]["app.kubernetes.io/name"] == "card-redis"
    for client in (c for c in card_containers(rendered) if c.script in ("card-target", "card-draft")):
        script = client.script
        # the kubelet probes the pod IP, so every gRPC server must listen beyond loopback
        host = effective(command_for(script), client.env, "--host")
        assert host in BIND_ALL, f"{script} listens on {host} only"
        addr = effective(command_for(script), client.env, "--cache")
        host, _, port = addr.rpartition(":")
        svc = service_address(rendered, host, int(port))
        assert svc["spec"]["selector"].items() <= cache.pod["metadata"]["labels"].items(), (
            f"{script} dials Service {host}, which does not select the cache")
        sp = next(p for p in svc["spec"]["ports"] if p["port"] == int(port))
        assert sp["targetPort"] in ("grpc", cache.port("grpc")), f"{script} reaches the cache on another port"


def is_hardened(rendered: Rendered) -> bool:
    """components/hardened applied: it removes the one policy that opens the internet."""
    return "card-model-download" not in {p["metadata"]["name"] for p in rendered.of_kind("NetworkPolicy")}


def test_redis_password_comes_from_one_secret_and_never_in_arguments(variant: tuple[str, Rendered]) -> None:
    """The cache's Redis URL and Redis's requirepass come from one Secret (card-redis: url holds
    password); Redis reads the password on its standard input, not in its arguments (which ps
    shows), and its probes authenticate; the eviction policy keeps Redis taking records when full."""
    _, rendered = variant
    optional = not is_hardened(rendered)  # components/hardened requires every Secret
    (cache,) = [c for c in card_containers(rendered) if c.script == "card-cache"]
    url = next(v for v in cache.container["env"] if v["name"] == "CARD_CACHE_REDIS_URL")
    assert url["valueFrom"]["secretKeyRef"] == {"name": "card-redis", "key": "url", "optional": optional}
    # without the Secret the ConfigMap's URL is used: no password there
    fallback = urlsplit(configmap_env(rendered, cache.container)["CARD_CACHE_REDIS_URL"])
    assert fallback.password is None
    redis = rendered.get("Deployment", "card-redis")["spec"]["template"]["spec"]["containers"][0]
    env = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in redis["env"]}
    assert env == {n: {"name": "card-redis", "key": "password", "optional": optional}
                   for n in ("REDIS_PASSWORD", "REDISCLI_AUTH")}
    script = redis["command"][2]
    assert redis["command"][:2] == ["sh", "-c"]
    assert "redis-server - " in script and "$REDIS_PASSWORD" in script
    assert not any("requirepass" in a or "PASSWORD" in a for a in redis["args"])
    args = redis["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru" and "--maxmemory" in args
    for kind in ("readinessProbe", "livenessProbe"):
        assert redis[kind]["exec"]["command"] == ["redis-cli", "ping"]  # REDISCLI_AUTH authenticates it


def test_resources_grace_periods_and_security(variant: tuple[str, Rendered]) -> None:
    _, rendered = variant
    for dep in rendered.of_kind("Deployment"):
        spec = dep["spec"]["template"]["spec"]
        name = dep["metadata"]["name"]
        assert spec.get("terminationGracePeriodSeconds", 0) >= 10, f"{name}: grace period"
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec.get("automountServiceAccountToken") is False, f"{name}: no pod calls the Kubernetes API"
        for container in spec["containers"]:
            res = container["resources"]
            for section in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(section, {})), f"{name}: {section} cpu/memory"
            gpu_req = res["requests"].get("nvidia.com/gpu")
            assert gpu_req == res["limits"].get("nvidia.com/gpu"), f"{name}: GPU request != limit"
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])}, f"{name}: unknown volume"
    for c in card_containers(rendered):
        mounts = {m["mountPath"] for m in c.container["volumeMounts"]}
        assert {"/tmp", dockerfile_volume()} <= mounts, f"{c.script}: read-only root needs /tmp and /cache"


def test_draft_workers_scale_and_swap_independently(variant: tuple[str, Rendered]) -> None:
    _, rendered = variant
    drafts = [c for c in card_containers(rendered) if c.script == "card-draft"]
    for draft in drafts:
        if draft.deployment["metadata"]["name"] == "card-draft":
            assert draft.deployment["spec"]["replicas"] == 2
        explicit = {v["name"]: v for v in draft.container["env"]}
        # `kubectl set env deploy/card-draft CARD_DRAFT_MODEL=...` edits this entry in place
        assert explicit["CARD_DRAFT_MODEL"]["value"]
        # one literal name for every replica would make them replace each other in the registry
        assert "CARD_DRAFT_NAME" not in draft.env or "valueFrom" in explicit.get("CARD_DRAFT_NAME", {})
    assert "CARD_DRAFT_MODEL" in accepted_envvars(command_for("card-draft"))
    assert "CARD_TARGET_MODEL" in accepted_envvars(command_for("card-target"))
    assert not any(s["spec"]["selector"].get("app.kubernetes.io/name") == "card-draft"
                   for s in rendered.of_kind("Service")), "nothing dials a draft worker"


# ---- draft pools ----------------------------------------------------------------------------
def drafts_of(rendered: Rendered) -> dict[str, CardContainer]:
    """Each draft Deployment's container by its pool (CARD_DRAFT_POOL in its own env)."""
    pools: dict[str, CardContainer] = {}
    for c in (c for c in card_containers(rendered) if c.script == "card-draft"):
        name = c.deployment["metadata"]["name"]
        explicit = {v["name"]: v for v in c.container.get("env", [])}
        pool = explicit.get("CARD_DRAFT_POOL", {}).get("value")
        assert pool, f"{name}: CARD_DRAFT_POOL belongs in the Deployment's env, each pool naming its own"
        assert pool not in pools, f"pool {pool} is served by two Deployments"
        pools[pool] = c
    return pools


def test_every_draft_deployment_serves_one_named_pool(variant: tuple[str, Rendered]) -> None:
    """A worker without a pool joins the one its model names, so each Deployment says its pool,
    and not through card-draft-config, which every pool's pods read. The pool label is on the
    Deployment (so `kubectl get deploy -l card.ai/pool=...` and label-targeted patches find it),
    its selector and its pods (so `kubectl get pods -l ...` lists one pool's workers)."""
    from card.common.drafts import POOL_NAME

    _, rendered = variant
    pools = drafts_of(rendered)
    assert pools, "no draft Deployment"
    card_draft = command_for("card-draft")
    for pool, c in pools.items():
        name = c.deployment["metadata"]["name"]
        assert POOL_NAME.fullmatch(pool), f"{name}: {pool!r} is not a pool name"
        assert effective(card_draft, c.env, "--pool") == pool, name
        for source in c.container.get("envFrom", []):
            shared = rendered.get("ConfigMap", source["configMapRef"]["name"])["data"]
            assert "CARD_DRAFT_POOL" not in shared, f"{name}: a ConfigMap every pool reads sets the pool"
        for where, labels in (("metadata", c.deployment["metadata"]["labels"]),
                              ("selector", c.deployment["spec"]["selector"]["matchLabels"]),
                              ("pod template", c.pod["metadata"]["labels"])):
            assert labels.get(POOL_LABEL) == pool, f"{name}: {where} label {POOL_LABEL} is not {pool!r}"
            assert labels.get("app.kubernetes.io/name") == "card-draft", f"{name}: {where}"
        assert c.deployment["metadata"]["labels"]["app.kubernetes.io/component"] == "draft", name
        # pods are named <deployment>-<10>-<5>: keep that a DNS label (the pod's host name)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 47, name
        # the base's Deployment is the pool `default` (what the docs drain and replace)
        assert name != "card-draft" or pool == "default", name


def test_no_deployment_selects_another_deployments_pods(variant: tuple[str, Rendered]) -> None:
    """Two Deployments whose selectors overlap fight over each other's pods: every pool's
    selector must match its own pods and no other pool's (nor any other service's)."""
    _, rendered = variant
    deployments = rendered.of_kind("Deployment")
    for dep in deployments:
        selector = dep["spec"]["selector"]["matchLabels"].items()
        for other in deployments:
            labels = other["spec"]["template"]["metadata"]["labels"].items()
            own = other is dep
            what = "does not select its own pods" if own else f"selects {other['metadata']['name']}'s pods"
            assert (selector <= labels) == own, f"Deployment {dep['metadata']['name']} {what}"


def prestop_sleep_s(container: dict) -> float:
    """Seconds a preStop hook holds off SIGTERM (a sleep action or an exec of sleep); 0 without."""
    hook = container.get("lifecycle", {}).get("preStop")
    if not hook:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = " ".join(hook["exec"]["command"])
    match = re.fullmatch(r"(?:/bin/)?(?:sh -c )?sleep (\d+(?:\.\d+)?)", command)
    assert match, f"a preStop other than a sleep: {command!r}"
    return float(match.group(1))


def test_draft_grace_period_outlasts_the_drain(variant: tuple[str, Rendered]) -> None:
    """SIGTERM drains a worker (no new session, live ones handed over) for at most
    --drain-timeout-s, after any preStop; the kubelet must not SIGKILL it first. The timeout is
    set in the manifests, so the grace period is sized against a value they show."""
    _, rendered = variant
    for pool, c in drafts_of(rendered).items():
        assert "CARD_DRAFT_DRAIN_TIMEOUT_S" in c.env, f"pool {pool}: drain timeout left to the default"
        drain = float(effective(command_for("card-draft"), c.env, "--drain-timeout-s"))
        grace = c.pod["spec"]["terminationGracePeriodSeconds"]
        needed = prestop_sleep_s(c.container) + drain + 10  # 10 s to close streams and exit
        assert grace >= needed, f"pool {pool}: grace {grace} s < {needed} s (preStop + drain + margin)"


def test_weights_and_the_default_pool_name_pools_that_are_deployed(variant: tuple[str, Rendered]) -> None:
    """card-cache --pool-weights and card-target --default-pool parse, and name pools some draft
    Deployment serves (a stale name keeps a pool that no worker serves in the routing)."""
    from card.common.drafts import parse_pool_weights

    _, rendered = variant
    pools = set(drafts_of(rendered))
    by_script = {c.script: c for c in card_containers(rendered)}
    weights = parse_pool_weights(effective(command_for("card-cache"), by_script["card-cache"].env,
                                           "--pool-weights"))
    assert {p for p, _ in weights} <= pools, f"weights {weights} name pools not deployed ({sorted(pools)})"
    default = effective(command_for("card-target"), by_script["card-target"].env, "--default-pool")
    assert default in ("", *pools), f"--default-pool {default!r} is not deployed ({sorted(pools)})"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_pool_component_adds_a_cpu_pool_run_like_the_base_draft(overlay: str, tmp_path: Path) -> None:
    """The component adds one Deployment and changes nothing else; its pods are probed, secured,
    configured and drained as the base's, and it runs int8 on CPU whatever the overlay's device."""
    plain = render_variant(overlay, tmp_path / "plain")
    rendered = render_variant(f"{overlay}+pool", tmp_path / "pool")
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    added = {key(o) for o in rendered.objects} - {key(o) for o in plain.objects}
    assert added == {("Deployment", "card-draft-qwen-05b-int8"),
                     ("PodDisruptionBudget", "card-draft-qwen-05b-int8")}
    for obj in plain.objects:
        assert rendered.get(obj["kind"], obj["metadata"]["name"]) == obj, f"{key(obj)} changed"
    pools = drafts_of(rendered)
    assert set(pools) == {"default", "qwen-05b-int8"}
    base, new = pools["default"], pools["qwen-05b-int8"]
    for field_ in ("command", "envFrom", "ports", "startupProbe", "readinessProbe", "livenessProbe",
                   "securityContext", "volumeMounts"):
        assert new.container[field_] == base.container[field_], f"the pool's {field_} differs from the base's"
    for field_ in ("securityContext", "terminationGracePeriodSeconds"):
        assert new.pod["spec"][field_] == base.pod["spec"][field_], field_
    assert new.pod["metadata"]["annotations"] == base.pod["metadata"]["annotations"]
    assert new.deployment["spec"]["strategy"] == base.deployment["spec"]["strategy"]
    assert {v["name"] for v in new.pod["spec"]["volumes"]} == {v["name"] for v in base.pod["spec"]["volumes"]}
    card_draft = command_for("card-draft")
    assert effective(card_draft, new.env, "--device") == "cpu"
    assert effective(card_draft, new.env, "--quantize") == "int8"
    assert effective(card_draft, new.env, "--dtype") == "float32"
    assert "nvidia.com/gpu" not in new.container["resources"]["limits"]
    assert "nodeSelector" not in new.pod["spec"]
    # added after the overlay's image transform: it names its tag itself (never :latest)
    assert new.container["image"] == f"{IMAGE}:{VERSION}-cpu"
    # another model, or the same one run otherwise (overlays/gpu: Qwen2.5-0.5B in bfloat16 on GPU)
    run = lambda c: [effective(card_draft, c.env, f) for f in ("--model", "--quantize", "--device")]  # noqa: E731
    assert run(new) != run(base)


def test_docs_walkthrough_overlays_and_names_match_the_manifests(tmp_path: Path) -> None:
    """docs/deploy.md section 4 replaces the pool `default` by the component's: its overlays render
    (the generic tests run on each, see VARIANTS), the last one serves the new pool alone, and
    every Deployment (`deploy/NAME`) and pool (`--pool NAME`, `--draft NAME`) it names exists."""
    from card.common.drafts import parse_pool_weights

    docs = [n for n in VARIANTS if n.startswith("docs#") and POOL_COMPONENT in VARIANTS[n].components]
    assert len(docs) >= 3, "the walkthrough's overlays (add as a canary, shift, remove) are in the docs"
    rendered = {n: render_variant(n, tmp_path / re.sub(r"\W+", "-", n)) for n in VARIANTS}
    first, last = rendered[docs[0]], rendered[docs[-1]]
    cache = next(c for c in card_containers(first) if c.script == "card-cache")
    weights = dict(parse_pool_weights(effective(command_for("card-cache"), cache.env, "--pool-weights")))
    assert set(drafts_of(first)) == {"default", "qwen-05b-int8"}
    assert 0 < weights["qwen-05b-int8"] < weights["default"], "the new pool starts as a small canary"
    assert set(drafts_of(last)) == {"qwen-05b-int8"}, "the walkthrough ends with the new pool alone"
    deployments = {d["metadata"]["name"] for r in rendered.values() for d in r.of_kind("Deployment")}
    pools = {p for r in rendered.values() for p in drafts_of(r)}
    text = DOCS.read_text()
    named = set(re.findall(r"(?<![\w./])deploy/([a-z0-9-]+)(?![\w./])", text))  # not deploy/k8s/...
    assert named <= deployments, f"docs/deploy.md names Deployments no manifest has: {named - deployments}"
    pool_refs = set(re.findall(r"--(?:pool|draft)[ =]([a-z0-9][a-z0-9._-]*)", text))
    for weights in re.findall(r"POOL_WEIGHTS=([^\s`]+)", text):
        pool_refs |= set(re.findall(r"([\w.-]+)=", weights))
    assert pool_refs <= pools, f"docs/deploy.md names pools no manifest deploys: {pool_refs - pools}"


def device_of(rendered: Rendered, script: str) -> str:
    c = next(c for c in card_containers(rendered) if c.script == script)
    return effective(command_for(script), c.env, "--device")


def gpus(rendered: Rendered, script: str) -> int:
    c = next(c for c in card_containers(rendered) if c.script == script)
    return int(c.container["resources"]["limits"].get("nvidia.com/gpu", 0))


def test_cpu_overlay_runs_everything_on_cpu() -> None:
    rendered = render(OVERLAYS["cpu"])
    for script in ("card-cache", "card-target"):
        assert device_of(rendered, script) == "cpu"
        assert gpus(rendered, script) == 0
    assert gpus(rendered, "card-draft") == 0
    assert all(c.container["image"] == f"{IMAGE}:{VERSION}-cpu" for c in card_containers(rendered))
    assert "nvidia.com" not in yaml.safe_dump(rendered.objects)


@pytest.mark.parametrize("with_cache_gpu", [False, True])
def test_gpu_overlay_requests_gpus_and_selects_gpu_nodes(with_cache_gpu: bool) -> None:
    rendered = render(OVERLAYS["gpu"], components=(CACHE_GPU,) if with_cache_gpu else ())
    on_gpu = ("card-target", "card-draft", *(("card-cache",) if with_cache_gpu else ()))
    for c in card_containers(rendered):
        assert c.container["image"] == f"{IMAGE}:{VERSION}-cuda"
        pod = c.pod["spec"]
        if c.script in on_gpu:
            assert gpus(rendered, c.script) == 1, c.script
            assert pod["nodeSelector"], c.script
            assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), c.script
            assert device_of(rendered, c.script) == "cuda", c.script
        else:
            assert gpus(rendered, c.script) == 0 and device_of(rendered, c.script) != "cuda", c.script
    target = next(c for c in card_containers(rendered) if c.script == "card-target")
    assert effective(command_for("card-target"), target.env, "--dtype") == "bfloat16"
    # the persistent model cache: a ReadWriteOnce claim, so the target must not surge a second pod
    models = next(v for v in target.pod["spec"]["volumes"] if v["name"] == "models")
    assert set(models) == {"name", "persistentVolumeClaim"}
    rendered.get("PersistentVolumeClaim", models["persistentVolumeClaim"]["claimName"])
    assert target.deployment["spec"]["strategy"] == {"type": "Recreate"}


def _sort_named_lists(node: object) -> object:
    """Lists merged by name (containers, env, volumes) compare as sets: kustomize moves patched
    entries first, an order Kubernetes gives no meaning to here."""
    if isinstance(node, dict):
        return {k: _sort_named_lists(v) for k, v in node.items()}
    if isinstance(node, list):
        items = [_sort_named_lists(i) for i in node]
        if items and all(isinstance(i, dict) and "name" in i for i in items):
            items.sort(key=lambda i: i["name"])
        return items
    return node


def _comparable(objects: list[dict]) -> list[dict]:
    """Drop kustomize's ConfigMap hash suffixes and sort, to compare two renderings."""
    text = yaml.safe_dump([{k: v for k, v in o.items() if k != "_generated"} for o in objects])
    text = re.sub(r"(card-\w+-config)-[a-z0-9]{10}\b", r"\1", text)
    docs = [_sort_named_lists(o) for o in yaml.safe_load(text)]
    return sorted(docs, key=lambda o: (o["kind"], o["metadata"]["name"]))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_python_rendering_matches_kubectl_kustomize(name: str, tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the rendering cross-check needs `kubectl kustomize`")
    overlay = VARIANTS[name].write(tmp_path)  # an overlay of the variant, as an operator writes one
    done = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {name}: {done.stderr}"
    theirs = _comparable([d for d in yaml.safe_load_all(done.stdout) if d])
    ours = _comparable(render(overlay).objects)
    for obj in ours:  # kustomize writes generated ConfigMaps with no other fields
        assert obj in theirs, f"{obj['kind']}/{obj['metadata']['name']} renders differently"
    assert len(ours) == len(theirs)


# ---- the image ------------------------------------------------------------------------------
DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


def dockerfile_volume() -> str:
    match = re.search(r'^VOLUME \["([^"]+)"\]', DOCKERFILE, re.M)
    assert match, "the Dockerfile declares the model cache VOLUME"
    return match.group(1)


def test_image_has_no_entrypoint_runs_as_non_root_and_caches_models_on_the_volume() -> None:
    assert not re.search(r"^ENTRYPOINT", DOCKERFILE, re.M), "each Deployment chooses its command"
    user = re.findall(r"^USER (\S+)", DOCKERFILE, re.M)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    volume = dockerfile_volume()
    for var in ("HF_HOME", "CARD_MODELS_DIR"):
        match = re.search(rf"\b{var}=(\S+)", DOCKERFILE)
        assert match and match.group(1).startswith(volume + "/"), f"{var} must live on {volume}"
    # the CPU flavour pins the torch the rest of the project is built and tested with
    makefile_torch = re.search(r"^TORCH_VERSION \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert makefile_torch and f"ARG TORCH_VERSION={makefile_torch.group(1)}" in DOCKERFILE
    assert re.search(r"^ARG TORCH_FLAVOUR=cpu$", DOCKERFILE, re.M)


def test_image_bundles_the_default_model_wheel_the_engine_asks_for() -> None:
    embedded = importlib.import_module("card.engine.loading.embedded")
    gguf_cache = importlib.import_module("card.engine.loading.gguf_cache")
    assert {embedded.MODELS_DIR_ENV, embedded.FIND_LINKS_ENV, gguf_cache.CACHE_ENV} == ENGINE_ENVVARS
    match = re.search(r"^ARG DEFAULT_MODEL_WHEEL=(\S+)$", DOCKERFILE, re.M)
    assert match and match.group(1) == embedded.SMOLLM2.requirement
    folder = re.search(r"\bCARD_DEFAULT_MODEL_FIND_LINKS=(\S+)", DOCKERFILE)
    assert folder and f"-d {folder.group(1)} " in DOCKERFILE, "the wheel goes where the engine looks"


def test_dockerignore_keeps_everything_pip_install_needs() -> None:
    ignore = DEPLOY / "Dockerfile.dockerignore"  # BuildKit reads <Dockerfile>.dockerignore
    patterns = [ln.strip().rstrip("/") for ln in ignore.read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    tool = PYPROJECT["tool"]["setuptools"]
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]}
    # the top folder of every package: `card` lives in protos/ (package-dir), the rest at the root
    needed |= {tool["package-dir"].get(p.split(".")[0], p.split(".")[0]).split("/")[0]
               for p in tool["packages"]}
    kept_out = sorted(needed & set(patterns))
    assert not kept_out, f"the image build needs {kept_out}"
