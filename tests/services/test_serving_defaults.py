"""card-target's serving defaults are vllm serve's: the OpenAI API on port 8000 beside gRPC,
``--served-model-name`` (several; the first reported), the model's context window, one line with
the URL a client is pointed at.

The user's run is real: the entry point as a subprocess with no port flag at all, in a network
namespace of its own (``unshare --net``), so its default ports (8000, 50051, 9091) are free
whatever else runs on this machine, and the official ``openai`` package as the client, run in that
namespace (``nsenter``). Every other test passes OS-chosen ports; the second test starts two
targets at once the way the tests' fixtures and LocalTrio do, and the negative control shows why
they must: a second target on the defaults is refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from card.client.trio import HTTP_LISTENING, LocalTrio, console_script
from card.engine.loading.models import ModelConfig
from card.engine.shared.errors import InvalidArgument
from card.target_service.config import TargetConfig
from tests.services.conftest import stop_process
from tests.tiny_models import save_tiny_checkpoint

URL_LINE = re.compile(r"^card-target: OpenAI API on (\S+) \(model (\S+)\)$", re.MULTILINE)
KV_LINE = re.compile(r"^.*KV cache: (\d+) slots x (\d+) tokens \([\d.]+ GB\): (.*)$", re.MULTILINE)

# The client a vLLM user runs, unmodified: the openai package against the printed base URL.
CLIENT = r"""
import json, sys
import openai
base_url, names = sys.argv[1], sys.argv[2].split(",")
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
out = {"models": [m.id for m in client.models.list().data], "chat": {}, "completion": {}}
for name in names:
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    out["chat"][name] = [chat.model, chat.choices[0].finish_reason, chat.usage.completion_tokens]
    done = client.completions.create(model=name, prompt="The capital of France", max_tokens=3, temperature=0)
    out["completion"][name] = [done.model, done.choices[0].text]
try:
    client.completions.create(model="not-served", prompt="x", max_tokens=1)
except openai.NotFoundError as err:
    out["unknown"] = [err.status_code, err.message]
print(json.dumps(out))
"""


def _can_unshare() -> str:
    """Why a private network namespace cannot be made here ("" if it can)."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "nsenter", "ip")):
        return "a network namespace of its own needs root, unshare, nsenter and ip (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "--net", "--", "ip", "link", "set", "lo", "up"], capture_output=True,
                           text=True, timeout=30)
    return "" if probe.returncode == 0 else f"unshare --net failed: {probe.stderr.strip()}"


def _environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    return {**env, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def _wait(pattern: re.Pattern, path: Path, proc: subprocess.Popen, err: Path, timeout_s: float = 180
          ) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = pattern.search(path.read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            raise AssertionError(f"card-target exited ({proc.returncode}):\n{err.read_text()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {pattern.pattern!r} within {timeout_s:g}s:\n{err.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("defaults-model") / "target", seed=0))


@pytest.fixture
def own_netns() -> Iterator[None]:
    why = _can_unshare()
    if why:
        pytest.skip(why)
    yield


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_target_started_like_vllm_serve_answers_the_openai_client(checkpoint: str, tmp_path: Path,
                                                                    own_netns: None) -> None:
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    cmd = [console_script("card-target"), "--model", checkpoint, "--served-model-name", "tiny-chat",
           "--served-model-name", "alias-a,alias-b", "--threads", "1"]
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
                                 *cmd], stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=_environ(),
                                start_new_session=True)
    try:
        url, model = _wait(URL_LINE, out, proc, err).groups()
        assert (url, model) == ("http://127.0.0.1:8000/v1", "tiny-chat")  # vllm serve's port, the first name
        assert "card-target listening on 127.0.0.1:50051" in out.read_text()  # gRPC beside it, as before
        kv = KV_LINE.findall(err.read_text())
        assert len(kv) == 1 and kv[0][:2] == ("8", "512"), kv  # the tiny model's whole context window
        assert kv[0][2].startswith("the model's context window"), kv

        in_its_netns = ["nsenter", f"--net=/proc/{proc.pid}/ns/net", "--"]
        client = subprocess.run([*in_its_netns, sys.executable, "-c", CLIENT, url,
                                 "tiny-chat,alias-a,alias-b"], capture_output=True, text=True, timeout=120,
                                env=_environ())
        assert client.returncode == 0, client.stderr[-3000:]
        seen = json.loads(client.stdout)
        assert seen["models"] == ["tiny-chat", "alias-a", "alias-b"]  # the reported name first
        for name in ("tiny-chat", "alias-a", "alias-b"):  # any name is served; the first is reported
            assert seen["chat"][name] == ["tiny-chat", "length", 4]
            assert seen["completion"][name] == seen["completion"]["tiny-chat"]
        status, message = seen["unknown"]
        assert status == 404 and "'tiny-chat', 'alias-a', 'alias-b'" in message

        # negative control: a second target on the same defaults cannot have port 8000, and says so
        # in one line; the tests' own targets pass OS-chosen ports for this reason
        second = subprocess.run([*in_its_netns, *cmd, "--port", "0", "--metrics-port", "0"],
                                capture_output=True, text=True, timeout=120, env=_environ())
        assert second.returncode == 2, second.stderr[-3000:]
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("card-target: ") and "127.0.0.1:8000" in last and "--http-port" in last, last
        assert "Traceback" not in second.stderr
    finally:
        stop_process(proc, 30)
    assert proc.returncode == 0, err.read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_targets_the_tests_start_at_once_do_not_collide(checkpoint: str, tmp_path: Path) -> None:
    """Two targets started at once, on the ports the tests' fixtures and LocalTrio give them
    (OS-chosen, or no HTTP at all), both serve; LocalTrio without an HTTP port passes --no-http."""
    assert "--no-http" in LocalTrio().target_args()
    assert LocalTrio(http_port=0).target_args()[-2:] == ["--http-port", "0"]
    procs = []
    try:
        for i in range(2):
            out, err = tmp_path / f"stdout-{i}.log", tmp_path / f"stderr-{i}.log"
            with open(out, "wb") as o, open(err, "wb") as e:
                procs.append((subprocess.Popen(
                    [console_script("card-target"), "--model", checkpoint, "--port", "0", "--http-port", "0",
                     "--metrics-port", "0", "--threads", "1"], stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                    env=_environ(), start_new_session=True), out, err))
        ports = set()
        for proc, out, err in procs:
            url, model = _wait(URL_LINE, out, proc, err).groups()
            port = _wait(HTTP_LISTENING, out, proc, err).group(2)
            assert url == f"http://127.0.0.1:{port}/v1" and model == checkpoint  # default name: --model
            models = httpx.get(f"{url}/models", timeout=30).json()
            assert [m["id"] for m in models["data"]] == [checkpoint]
            ports.add(port)
        assert len(ports) == 2
    finally:
        for proc, _, _ in procs:
            stop_process(proc, 30)


def test_served_model_names_are_flags_with_vllm_semantics() -> None:
    model = ModelConfig("some/model")
    assert TargetConfig(model=model).served_names == ("some/model",)  # default: the --model string
    config = TargetConfig.from_options(model="some/model", dtype="auto", device="auto", exact=True,
                                       cache_addr=None, api_key=None, target_token=None,
                                       served_model_name=("chat", "a,b", "chat"))
    assert config.served_names == ("chat", "a", "b")  # repeated or comma-separated, once each, in order
    assert (config.http_port, config.http_interface) == (8000, "127.0.0.1")
    off = TargetConfig.from_options(model="m", dtype="auto", device="auto", exact=True, cache_addr=None,
                                    api_key=None, target_token=None, http=False, host="0.0.0.0")
    assert off.http_port is None and off.http_interface == "0.0.0.0"  # one --host opens both APIs
    for bad in ("", "two words", "x" * 257):
        with pytest.raises(InvalidArgument, match="served model name"):
            TargetConfig(model=model, served_model_names=(bad,))
