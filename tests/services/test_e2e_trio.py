"""End to end through the entry points, as a user starts them: redis-server, card-cache,
card-draft (several) and card-target as subprocesses on OS-chosen loopback ports, tiny float64
checkpoints that share the real SmolLM2 tokenizer. One trio for the whole module.

Drafts: "same" (the target's own checkpoint: speculation must hit), "pert" (the target perturbed
by 0.02) and "foreign" (a tokenizer with one extra token: must be refused).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from card.client.remote import generate_remote
from card.client.trio import LocalTrio, console_script, free_port
from card.common.channels import health_status
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import SamplingParams, StopParams
from card.engine.shared.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unauthenticated,
    Unavailable,
)
from card.v1 import cache_pb2, cache_pb2_grpc, common_pb2, target_pb2, target_pb2_grpc
from tests.services.e2e_support import metric, scrape, torch_threads, vanilla_reference, wait_until
from tests.tiny_models import save_foreign_tokenizer_checkpoint, save_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ("Write a haiku about the sea.", "What is two plus two?", "Name three colours.",
           "Tell me a story about a fox.")
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-models")
    return {
        "target": save_tiny_checkpoint(root / "target", seed=0),
        "pert": save_tiny_checkpoint(root / "pert", seed=0, perturb=0.02),
        "foreign": save_foreign_tokenizer_checkpoint(root / "foreign", seed=0),
    }


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"e2e-{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
def trio(checkpoints, redis_server, prefix, tmp_path_factory):
    trio = LocalTrio(speculation="always",
                     target_model=str(checkpoints["target"]), draft_model=str(checkpoints["target"]),
                     draft_name="same", target_threads=1, draft_threads=1, dtype="float64",
                     log_dir=tmp_path_factory.mktemp("e2e-logs"), redis_url=redis_server.url,
                     metrics=True, start_timeout_s=240,
                     extra_args={"cache": ["--redis-prefix", prefix],
                                 # KV slots of 480 rows, below the tiny model's 512-token window
                                 "target": ["--max-model-len", "480"]})
    with trio:
        extra = [trio.start_draft(str(checkpoints[name]), name=name, wait=False)
                 for name in ("pert", "foreign")]
        for proc in extra:
            proc.wait_listening(240)
            proc.wait_serving(240)
        yield trio


@pytest.fixture(scope="module")
def reference(checkpoints):
    model = load_model(ModelConfig(str(checkpoints["target"]), dtype="float64", exact=True))
    run = vanilla_reference(model)

    def one_thread(*args):
        with torch_threads(1):
            return run(*args)

    return one_thread


# ---- (1) exactness -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["card", "vanilla"])
def test_greedy_output_equals_in_process_vanilla(trio, reference, mode):
    stop = StopParams(48, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        remote = generate_remote(trio.target_addr, prompt, sampling=GREEDY, stop=stop, mode=mode,
                                 draft="same" if mode == "card" else None, timeout_s=60)
        ref = reference(prompt, GREEDY, stop)
        assert remote.token_ids == ref.token_ids
        assert remote.text == ref.text
        assert remote.finish_reason == "length"
        assert remote.stats.new_tokens == 48 and remote.stats.mode == mode
        if mode == "card":
            assert remote.draft == "same"
            # one per step sent: the first steps are plain while the session opens beside the prefill
            assert 0 < len(remote.stats.step_rtt_ms) <= remote.stats.target_forwards - 1
        else:
            assert remote.stats.step_rtt_ms == [] and remote.draft == ""


def test_seeded_sampling_equals_seeded_vanilla(trio, reference):
    stop = StopParams(40, ignore_eos=True)
    outputs = []
    for seed in (7, 8):
        sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=seed)
        remote = generate_remote(trio.target_addr, PROMPTS[2], sampling=sampling, stop=stop, timeout_s=60)
        assert remote.token_ids == reference(PROMPTS[2], sampling, stop).token_ids
        outputs.append(remote.token_ids)
    assert outputs[0] != outputs[1]  # the seed matters, so equality above means something


# ---- (2) concurrency -----------------------------------------------------------------------
def test_four_concurrent_generations_are_each_exact(trio, reference):
    """Four requests in one engine batch (joining as they arrive), each exactly what it gets alone;
    their Steps travel to the cache together (StepBatch), one round trip per target forward."""
    batches = metric(scrape(trio.metrics_ports["card-cache"]), "card_cache_step_batches_total")
    base = reference(PROMPTS[3], GREEDY, StopParams(40, ignore_eos=True)).text
    stop_string = base[len(base) // 2: len(base) // 2 + 3].strip() or base[-2:]
    jobs = [
        (PROMPTS[0], GREEDY, StopParams(40, ignore_eos=True), None),
        (PROMPTS[1], SamplingParams(temperature=1.0, seed=1), StopParams(36, ignore_eos=True), "same"),
        (PROMPTS[2], SamplingParams(temperature=0.7, top_k=20, seed=3), StopParams(32, ignore_eos=True),
         "pert"),
        (PROMPTS[3], GREEDY, StopParams(40, stop=(stop_string,), ignore_eos=True), None),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(generate_remote, trio.target_addr, p, sampling=s, stop=st, draft=d,
                               timeout_s=120) for p, s, st, d in jobs]
        results = [f.result() for f in futures]
    for (prompt, sampling, stop, _), remote in zip(jobs, results, strict=True):
        ref = reference(prompt, sampling, stop)
        assert remote.token_ids == ref.token_ids
        assert remote.text == ref.text and remote.finish_reason == ref.finish_reason
    assert results[3].finish_reason == "stop"
    assert metric(scrape(trio.metrics_ports["card-cache"]), "card_cache_step_batches_total") > batches


# ---- (4) several drafts, routed by name ----------------------------------------------------
def test_requests_are_routed_by_draft_name(trio, reference):
    stop = StopParams(24, ignore_eos=True)
    ref = reference(PROMPTS[0], GREEDY, stop)
    for name in ("same", "pert", "same"):
        remote = generate_remote(trio.target_addr, PROMPTS[0], sampling=GREEDY, stop=stop, draft=name,
                                 timeout_s=60)
        assert remote.draft == name
        assert remote.token_ids == ref.token_ids
    # unnamed: any worker whose tokenizer matches, never the foreign one
    for _ in range(3):
        remote = generate_remote(trio.target_addr, PROMPTS[0], sampling=GREEDY, stop=stop, timeout_s=60)
        assert remote.draft in ("same", "pert")
        assert remote.token_ids == ref.token_ids
    with grpc.insecure_channel(trio.cache_addr) as ch:
        status = cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=5)
    assert {d.name for d in status.drafts} == {"same", "pert", "foreign"}


# ---- (5) refusals --------------------------------------------------------------------------
def test_mismatched_tokenizer_is_refused_naming_both_models(trio, checkpoints):
    with pytest.raises(FailedPrecondition) as err:
        generate_remote(trio.target_addr, PROMPTS[0], draft="foreign", stop=StopParams(4), timeout_s=30)
    message = str(err.value)
    assert str(checkpoints["foreign"]) in message and str(checkpoints["target"]) in message


def test_unknown_draft_is_not_found(trio):
    with pytest.raises(NotFound, match="no-such-draft"):
        generate_remote(trio.target_addr, PROMPTS[0], draft="no-such-draft", stop=StopParams(4), timeout_s=30)


def test_bad_inputs_are_invalid_argument(trio):
    with pytest.raises(InvalidArgument, match="empty"):
        generate_remote(trio.target_addr, "", stop=StopParams(4), timeout_s=30)
    with pytest.raises(InvalidArgument, match="context window"):
        generate_remote(trio.target_addr, [100] * 600, stop=StopParams(4), timeout_s=30)
    with pytest.raises(InvalidArgument, match="--max-model-len"):  # fits the model, not the KV slots
        generate_remote(trio.target_addr, [100] * 490, stop=StopParams(4), timeout_s=30)
    with pytest.raises(InvalidArgument, match="context window"):
        generate_remote(trio.target_addr, "word " * 700, stop=StopParams(4), timeout_s=30)
    with pytest.raises(InvalidArgument, match="mode"):
        generate_remote(trio.target_addr, PROMPTS[0], mode="sd", stop=StopParams(4), timeout_s=30)


@pytest.mark.parametrize(("sampling", "word"), [
    (common_pb2.SamplingParams(temperature=-1.0), "temperature"),
    (common_pb2.SamplingParams(temperature=float("nan")), "temperature"),
    (common_pb2.SamplingParams(top_p=1.5), "top_p"),
    (common_pb2.SamplingParams(top_k=-3), "top_k"),
])
def test_bad_sampling_values_are_invalid_argument_on_the_wire(trio, sampling, word):
    # the client library validates too; send raw requests to check the server's own validation
    request = target_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=sampling, max_new_tokens=4)
    with grpc.insecure_channel(trio.target_addr) as ch, pytest.raises(grpc.RpcError) as err:
        list(target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert word in err.value.details()


def test_unreachable_target_names_the_address_and_the_fix():
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable) as err:
        generate_remote(addr, "hello", stop=StopParams(4), timeout_s=10)
    assert addr in str(err.value) and "card-client up" in str(err.value)


@pytest.mark.parametrize("args", [
    ["drafts", "--cache", "{addr}"],
    ["status", "--target", "{addr}", "--cache", "{addr}", "--draft", "{addr}"],
    ["generate", "--target", "{addr}", "hello"],
])
def test_cli_against_a_dead_address_prints_one_line(args):
    addr = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    proc = subprocess.run([console_script("card-client"), *(a.format(addr=addr) for a in args)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    if args[0] == "status":  # a table that says so, exit 1
        assert proc.stdout.count("unreachable") == 3
    else:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "UNAVAILABLE" in lines[0] and addr in lines[0], proc.stderr
        if args[0] == "generate":
            assert "card-client up" in lines[0]


def test_status_and_drafts_commands_show_the_live_trio(trio, checkpoints):
    run = [console_script("card-client")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    proc = subprocess.run([*run, "status", "--target", trio.target_addr, "--cache", trio.cache_addr,
                           "--draft", trio.draft_addr], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("SERVING") == 3
    assert str(checkpoints["target"]) in proc.stdout  # the target's Info
    assert "redis connected" in proc.stdout
    assert "totals:" in proc.stdout and "hit rate" in proc.stdout
    proc = subprocess.run([*run, "drafts", "--cache", trio.cache_addr], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    pools, workers = proc.stdout.split("\n\n")  # pools first, then workers
    names = [line.split()[0] for line in workers.splitlines()[1:]]
    assert sorted(names) == ["foreign", "pert", "same"]
    assert all(line.split()[2] == "serving" for line in workers.splitlines()[1:])  # the state column
    # each worker in its own pool (by default its model: here each checkpoint folder)
    assert len(pools.splitlines()) == 4 and pools.splitlines()[0].split()[:2] == ["pool", "weight"]


# ---- (3) a draft worker dies mid-generation ------------------------------------------------
def test_killing_the_draft_mid_generation_changes_nothing(trio, reference, checkpoints):
    """Six requests in flight on one draft; the draft is SIGKILLed mid-generation: all finish, all
    exact (each equals the same request served alone)."""
    victim = next(p for p in trio.drafts if p.name == "card-draft-same")
    stops = [StopParams(400 - 40 * i, ignore_eos=True) for i in range(6)]
    chunks: list[str] = []
    lock = threading.Lock()

    def on_text(text: str) -> None:
        with lock:
            chunks.append(text)
            if len(chunks) == 30:
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(10)

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(generate_remote, trio.target_addr, PROMPTS[i % 4], sampling=GREEDY, stop=stop,
                               draft="same", on_text=on_text, timeout_s=240) for i, stop in enumerate(stops)]
        results = [f.result() for f in futures]
    assert victim.proc.returncode == -signal.SIGKILL
    assert len(chunks) > 30  # the kill landed mid-generation
    for i, (stop, remote) in enumerate(zip(stops, results, strict=True)):
        assert remote.token_ids == reference(PROMPTS[i % 4], GREEDY, stop).token_ids
        assert remote.finish_reason == "length" and remote.stats.new_tokens == stop.max_new_tokens

    # a new worker under the same name: the next requests speculate again. The draft here costs
    # as much as the target, so whether it gets ahead enough to hit is a race on any one request;
    # the worker must serve every request and hit on at least one of a few.
    trio.start_draft(str(checkpoints["target"]), name="same")
    stop = StopParams(128, ignore_eos=True)
    summaries = []
    for prompt in PROMPTS[:4]:
        remote = generate_remote(trio.target_addr, prompt, sampling=GREEDY, stop=stop, draft="same",
                                 timeout_s=60)
        assert remote.draft == "same"
        assert remote.token_ids == reference(prompt, GREEDY, stop).token_ids
        assert remote.stats.draft_forwards > 0, remote.stats.summary()
        summaries.append(remote.stats.summary())
        if remote.stats.hits > 0:
            break
    assert remote.stats.hits > 0, summaries


def test_cache_restart_mid_generation_changes_nothing(trio, reference):
    """The cache goes away mid-generation (a rolling restart): the request finishes exactly by
    plain decoding, the drafts report NOT_SERVING and re-register with the new cache, and the next
    request speculates again."""
    cache = next(p for p in trio.processes if p.name == "card-cache")
    stop = StopParams(300, ignore_eos=True)
    chunks: list[str] = []

    def on_text(text: str) -> None:
        chunks.append(text)
        if len(chunks) == 10:
            cache.terminate()
            cache.wait(15)

    remote = generate_remote(trio.target_addr, PROMPTS[2], sampling=GREEDY, stop=stop, draft="same",
                             on_text=on_text, timeout_s=120)
    assert cache.proc.returncode == 0 and len(chunks) > 10
    assert remote.token_ids == reference(PROMPTS[2], GREEDY, stop).token_ids
    assert remote.stats.new_tokens == 300
    drafts = [p for p in trio.drafts if p.proc.poll() is None]
    for draft in drafts:
        wait_until(lambda d=draft: health_status(d.addr) == "NOT_SERVING", what=f"{draft.name} NOT_SERVING")

    trio.restart_cache()
    for draft in drafts:
        draft.wait_serving(60)  # registered again
    stop = StopParams(48, ignore_eos=True)
    expected = reference(PROMPTS[0], GREEDY, stop).token_ids

    def speculates() -> bool:
        # the target's channel finds the new cache within its reconnect backoff (<= 5 s); until
        # then requests decode alone, exactly
        remote = generate_remote(trio.target_addr, PROMPTS[0], sampling=GREEDY, stop=stop, draft="same",
                                 timeout_s=60)
        assert remote.token_ids == expected
        return remote.draft == "same" and remote.stats.hits > 0

    wait_until(speculates, timeout_s=30, what="speculation to resume after the cache restart")


# ---- (6) no state outlives its session -----------------------------------------------------
def test_chain_flags_travel_with_a_request(trio, reference, redis_server, prefix):
    """card-client generate --target ... --max-chain 1: the request's own session at the cache is
    capped (its record in Redis says so) and no verification carries more than one drafted token;
    the same cache serves other requests with its own setting."""
    client = redis_server.client()
    before = set(client.scan_iter(f"{prefix}finished:*"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    stop = StopParams(32, ignore_eos=True)
    proc = subprocess.run([console_script("card-client"), "generate", PROMPTS[0], "--target",
                           trio.target_addr, "--draft", "same", "--max-chain", "1", "--max-new-tokens", "32",
                           "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == reference(PROMPTS[0], GREEDY, stop).token_ids
    assert max(out["stats"]["accepted_lengths"]) <= 2, out["stats"]

    def new_records() -> set:  # written in the background once CloseSession reaches the cache
        return set(client.scan_iter(f"{prefix}finished:*")) - before

    def ours(exclude: set) -> list:
        # this prompt's 32-token sessions only: an earlier test's session may be recorded late
        return [k for k in new_records() - exclude if client.hget(k, "new_tokens") in (b"32", "32")
                and client.hget(k, "prompt_tokens") in (str(out["stats"]["prompt_tokens"]).encode(),
                                                        str(out["stats"]["prompt_tokens"]))]

    wait_until(lambda: len(ours(set())) == 1, what="the session's finished record")
    (key,) = ours(set())
    assert client.hget(key, "max_chain") in (b"1", "1")
    remote = generate_remote(trio.target_addr, PROMPTS[0], sampling=GREEDY, stop=stop, draft="same",
                             timeout_s=60)
    wait_until(lambda: len(ours({key})) == 1, what="the second session's finished record")
    (second,) = ours({key})
    assert int(client.hget(second, "max_chain")) > 1  # the cache's own setting for a plain request
    assert remote.token_ids == out["token_ids"]


def test_no_session_state_leaks(trio, redis_server, prefix):
    # a cancelled request must clean up too: stop reading mid-stream
    request = target_pb2.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=300, ignore_eos=True)
    with grpc.insecure_channel(trio.target_addr) as ch:
        stream = target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=60)
        next(stream)
        stream.cancel()

    def cache_is_empty() -> bool:
        with grpc.insecure_channel(trio.cache_addr) as ch:
            status = cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=5)
        return not status.sessions and all(d.active_sessions == 0 for d in status.drafts)

    wait_until(cache_is_empty, what="the cache to hold no sessions")
    assert metric(scrape(trio.metrics_ports["card-cache"]), "card_cache_sessions_open") == 0
    live_drafts = [p for p in trio.drafts if p.proc.poll() is None]
    assert len(live_drafts) == 3
    for draft in live_drafts:
        def idle(draft=draft) -> bool:
            page = scrape(draft.metrics_port)
            return (metric(page, "card_draft_kv_slots") == 0
                    and metric(page, "card_draft_active_sessions") == 0)
        wait_until(idle, what=f"{draft.name} to hold no KV")
    client = redis_server.client()
    assert list(client.scan_iter(f"{prefix}session:*")) == []
    finished = list(client.scan_iter(f"{prefix}finished:*"))
    assert finished
    assert all(client.ttl(k) > 0 for k in finished)  # finished records expire


def test_trio_stops_cleanly(trio):
    # runs last: SIGTERM to every service; each drains and exits 0 (the SIGKILLed worker aside)
    live = [p for p in trio.processes if p.proc.poll() is None]
    assert {p.name for p in live} >= {"card-cache", "card-target", "card-draft-pert", "card-draft-foreign"}
    logs = [p.log_path for p in trio.processes if p.name != "card-cache"]
    trio.stop()
    assert [p.proc.returncode for p in live] == [0] * len(live), [(p.name, p.proc.returncode) for p in live]
    assert not any("Traceback" in path.read_text() for path in logs)  # target and drafts


def test_up_serves_until_ctrl_c(checkpoints, reference, tmp_path):
    """``card-client up``: a trio of its own (private redis-server), the addresses on stdout, the
    OpenAI API (--http-host, the key from CARD_CLIENT_API_KEY, a served name), exact output, and
    Ctrl-C stops every service with exit status 0."""
    target = str(checkpoints["target"])
    key = "sk-up-" + uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CARD_")}, "CARD_CLIENT_API_KEY": key}
    proc = subprocess.Popen(
        [console_script("card-client"), "up", "--target-model", target, "--draft-model", target,
         "--target-port", "0", "--cache-port", "0", "--draft-port", "0", "--http-port", "0",
         "--http-host", "127.0.0.1", "--served-model-name", "tiny", "--target-threads", "1",
         "--draft-threads", "1", "--dtype", "float64", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )
    try:
        exports, lines = {}, []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("export "):
                exports = dict(item.split("=", 1) for item in line.split()[1:])
                break
        want = {"CARD_CLIENT_TARGET_ADDR", "CARD_CLIENT_CACHE_ADDR", "CARD_CLIENT_DRAFT_ADDR"}
        assert set(exports) == want, proc.stderr.read()
        addr = exports["CARD_CLIENT_TARGET_ADDR"]
        stop = StopParams(16, ignore_eos=True)
        remote = generate_remote(addr, PROMPTS[1], stop=stop, timeout_s=60, api_key=key)
        assert remote.token_ids == reference(PROMPTS[1], GREEDY, stop).token_ids
        with pytest.raises(Unauthenticated):  # the key guards gRPC too
            generate_remote(addr, PROMPTS[1], stop=stop, timeout_s=60)
        base = next(line.split()[1] for line in lines if line.startswith("http "))
        assert base.startswith("http://127.0.0.1:") and base.endswith("/v1") and "model tiny" in lines[-2]
        assert httpx.get(f"{base}/models", timeout=30).status_code == 401
        models = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert [m["id"] for m in models.json()["data"]] == ["tiny"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "stopped" in err
    for key in exports:
        assert health_status_or_none(exports[key]) is None  # nothing is left listening


def health_status_or_none(addr: str) -> str | None:
    try:
        return health_status(addr, timeout_s=1.0)
    except grpc.RpcError:
        return None
