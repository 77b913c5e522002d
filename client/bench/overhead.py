"""What the services add to plain decoding, per token: the same engine in this process, through
card-target alone (no cache: plain decoding), and through a trio started as ``card-client up``
starts one, in ONE run, interleaved round by round (other load on the machine hits every side
alike; compare ratios within a run, never across runs).

    python -m card.client.bench.overhead --rounds 3 --levels 1,8 --out trio-overhead.json

Every side decodes the same prompt token ids greedily (``ignore_eos``: every request makes
``--max-new-tokens`` tokens), closed loop: N clients each sending the prompts back to back.
Per side and level: aggregate tok/s, inter-token latency (the gaps between streamed commits per
token, p50 / p99) and exactness against the in-process outputs. ``--http`` measures the
services through their OpenAI API (streamed /v1/completions, as AIPerf does) instead of gRPC.

The in-process side is card.engine.target.scheduler.TargetEngine with as many KV slots as
card-target's --max-batch-size, stepped on this thread (the model loaded as ``card-client
generate`` loads it), its commits stamped as they come out of ``step``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import click
import torch

from card.client.bench import data, report
from card.client.bench.load import closed_loop, one_request
from card.client.bench.report import percentile
from card.client.trio import (
    HTTP_LISTENING,
    LocalTrio,
    ServiceProcess,
    console_script,
    die_with_parent,
    free_port,
)
from card.engine.loading.models import LoadedModel, ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, SamplingParams, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.torch_threads import name_os_thread, on_passing_thread
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine

Record = dict  # one request: tokens, stamps (s from its start, tokens per commit), wall
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process by thread group: "engine" (card-target's engine
    thread and its OpenMP workers, which take its name), "serving" (every other thread, gRPC,
    HTTP, metrics), and "process" (all of them, threads that ended included). On a loaded machine
    CPU time per token is what a side costs; wall time is what the load left it."""
    def ticks(stat: str) -> tuple[str, float, float]:
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        return comm, int(fields[11]) * _TICK_S, int(fields[12]) * _TICK_S

    out = {"engine": 0.0, "engine_sys": 0.0, "serving": 0.0}
    with open(f"/proc/{pid}/stat") as f:
        _, user, system = ticks(f.read())
        out["process"] = user + system
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                comm, user, system = ticks(f.read())
        except OSError:  # ended meanwhile
            continue
        if comm.startswith("target-engine"):
            out["engine"] += user + system
            out["engine_sys"] += system
        else:
            out["serving"] += user + system
    return out


def _gaps(stamps: Sequence[tuple[float, int]]) -> list[float]:
    return [(b - a) / n for (a, _), (b, n) in itertools.pairwise(stamps)]


def _closed_loop(prompts: Sequence[Sequence[int]], clients: int,
                 one: Callable[[Sequence[int]], Record]) -> tuple[list[Record], float]:
    """``clients`` threads, client c sending every prompt from prompt c on; records and wall time."""
    def record(c: int, i: int) -> Record:
        rec = one(prompts[i])
        rec["prompt_index"] = i
        return rec

    return closed_loop(len(prompts), clients, record)


class InProcess:
    """The engine on this thread, ``slots`` KV slots, closed loop of ``clients`` generations."""

    pid = None  # this process: the engine's CPU is its thread's (``cpu``: user, system seconds)

    def __init__(self, model: LoadedModel, threads: int, slots: int, max_len: int,
                 on_thread: bool = False) -> None:
        self.name = "inprocess-thread" if on_thread else "inprocess"
        self.on_thread = on_thread
        self.cpu = (0.0, 0.0)
        self.model = model
        self.threads = threads
        torch.set_num_threads(threads)
        self.engine = TargetEngine(model.model, KVPool(model.model, slots, max_len), 512, exact=model.exact)

    def _generation(self, prompt: Sequence[int], max_new_tokens: int) -> Generation:
        m = self.model
        request = GenerationRequest(tuple(prompt), SamplingParams(),
                                    StopParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        return Generation(request, NoDraft(), eos_ids=m.eos_ids, decode=m.decode,
                          context_window=m.context_window, mode="vanilla", model_name=m.name,
                          vocab_size=m.model.get_input_embeddings().num_embeddings)

    def run(self, prompts: Sequence[Sequence[int]], clients: int,
            max_new_tokens: int) -> tuple[list[Record], float]:
        if not self.on_thread:
            return self._run(prompts, clients, max_new_tokens)
        out: list = []  # as card-target runs it: on a thread of its own, started for it

        def run() -> None:
            name_os_thread("target-engine")
            out.append(self._run(prompts, clients, max_new_tokens))

        thread = threading.Thread(target=run, name="target-engine")
        thread.start()
        thread.join()
        return out[0]

    def _run(self, prompts: Sequence[Sequence[int]], clients: int,
             max_new_tokens: int) -> tuple[list[Record], float]:
        torch.set_num_threads(self.threads)
        usage0 = resource.getrusage(resource.RUSAGE_THREAD)
        engine = self.engine
        queues = [[(c + k) % len(prompts) for k in range(len(prompts))] for c in range(clients)]
        live: dict[Generation, Record] = {}
        records: list[Record] = []

        def admit(c: int) -> None:
            if queues[c]:
                i = queues[c].pop(0)
                gen = self._generation(prompts[i], max_new_tokens)
                live[gen] = {"prompt_index": i, "client": c, "t0": time.perf_counter(), "stamps": [],
                             "token_ids": []}
                engine.add(gen)

        t0 = time.perf_counter()
        for c in range(clients):
            admit(c)
        self.phases = {"plan": 0.0, "forward": 0.0, "commit": 0.0, "iterations": 0.0}
        while live:
            events = engine.step()
            now = time.perf_counter()
            if (times := engine.last) is not None:
                engine.last = None
                for phase in ("plan", "forward", "commit"):
                    self.phases[phase] += getattr(times, phase)
                self.phases["iterations"] += 1
            for event in events:
                rec = live[event.generation]
                if event.chunk is not None and event.chunk.token_ids:
                    rec["stamps"].append((now - rec["t0"], len(event.chunk.token_ids)))
                if event.done:
                    del live[event.generation]
                    result = event.generation.result
                    assert result is not None and event.error is None, event.error
                    rec["token_ids"] = list(result.token_ids)
                    rec["text"] = result.text
                    rec["wall_s"] = now - rec["t0"]
                    records.append(rec)
                    admit(rec["client"])
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        self.cpu = (usage.ru_utime - usage0.ru_utime, usage.ru_stime - usage0.ru_stime)
        return records, time.perf_counter() - t0

    def close(self) -> None:
        pass


class OverGrpc:
    """A card-target's gRPC Generate, streamed (card.client.bench.load.one_request)."""

    def __init__(self, name: str, addr: str, pid: int, metrics_port: int = 0) -> None:
        self.name, self.addr, self.pid, self.metrics_port = name, addr, pid, metrics_port

    def run(self, prompts: Sequence[Sequence[int]], clients: int,
            max_new_tokens: int) -> tuple[list[Record], float]:
        def one(prompt: Sequence[int]) -> Record:
            r = one_request(self.addr, list(prompt), "vanilla", max_new_tokens, True)
            return {"token_ids": r["token_ids"], "wall_s": r["wall_s"], "itl_s": r["itl_s"],
                    "ttft_s": r["ttft_s"]}

        return _closed_loop(prompts, clients, one)


class OverHttp:
    """A card-target's OpenAI API: streamed /v1/completions of the prompt's token ids, as AIPerf
    streams (one httpx client per request)."""

    def __init__(self, name: str, addr: str, model: str, pid: int, metrics_port: int = 0) -> None:
        self.name, self.url, self.model, self.pid = name, f"http://{addr}/v1/completions", model, pid
        self.metrics_port = metrics_port

    def run(self, prompts: Sequence[Sequence[int]], clients: int,
            max_new_tokens: int) -> tuple[list[Record], float]:
        import httpx

        def one(prompt: Sequence[int]) -> Record:
            body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_new_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "mode": "vanilla",
                    "stream_options": {"include_usage": True}}
            stamps: list[tuple[float, int]] = []
            text: list[str] = []
            tokens = 0
            t0 = time.perf_counter()
            with httpx.Client(timeout=600) as client, client.stream("POST", self.url, json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    msg = json.loads(line[6:])
                    if msg.get("usage"):
                        tokens = msg["usage"]["completion_tokens"]
                    for choice in msg.get("choices", ()):
                        if choice.get("text"):
                            stamps.append((time.perf_counter() - t0, 1))
                            text.append(choice["text"])
            wall = time.perf_counter() - t0
            return {"text": "".join(text), "new_tokens": tokens, "wall_s": wall,
                    "ttft_s": stamps[0][0] if stamps else wall, "itl_s": _gaps(stamps),
                    # AIPerf's inter-token latency: (last - first) / (tokens - 1)
                    "itl_mean_s": (stamps[-1][0] - stamps[0][0]) / max(tokens - 1, 1) if stamps else 0.0}

        return _closed_loop(prompts, clients, one)


def package_of(tree: Path, into: Path) -> Path:
    """A folder whose ``card`` package is ``tree``'s (another checkout, e.g. ``git archive HEAD``
    before a change), for PYTHONPATH: a service started with it runs that code, beside this
    one's, in the same run. Its folders as ``tree``'s pyproject.toml maps them (package-dir)."""
    import tomllib

    dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    card = into / "card"
    if not card.exists():
        card.mkdir(parents=True)
        for item in (tree / dirs["card"]).iterdir():
            (card / item.name).symlink_to(item.resolve())
        for name, folder in dirs.items():
            if name != "card":
                (card / name.removeprefix("card.")).symlink_to((tree / folder).resolve())
    return into


@contextlib.contextmanager
def target_alone(model: str, threads: int, http: bool, log_dir: Path, name: str = "target",
                 tree: Path | None = None) -> Iterator[ServiceProcess]:
    """card-target without a cache (plain decoding only), as a user starts it; ``tree``: the code
    of that source tree instead of this one."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"card-{name}-alone.log"
    metrics_port = free_port()
    args = ["--model", model, "--port", "0", "--threads", str(threads), "--metrics-port", str(metrics_port),
            *(["--http-port", "0"] if http else ["--no-http"])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if tree is not None:
        env["PYTHONPATH"] = str(package_of(tree, log_dir / f"{name}-package"))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(die_with_parent([console_script("card-target"), *args]), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=env)
    service = ServiceProcess("card-target", proc, log_path, metrics_port=metrics_port)
    try:
        service.addr = service.wait_listening(600)
        service.wait_serving(600)
        yield service
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def scrape_phases(metrics_port: int) -> dict[str, float]:
    """card-target's iteration seconds by phase (sums) and its iteration count, from /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {"plan": 0.0, "forward": 0.0, "commit": 0.0, "iterations": 0.0}
    for line in text.splitlines():
        if line.startswith("card_target_iteration_seconds_sum{"):
            phase = line.split('phase="', 1)[1].split('"', 1)[0]
            out[phase] = float(line.rsplit(" ", 1)[1])
        elif line.startswith('card_target_iteration_seconds_count{phase="forward"}'):
            out["iterations"] = float(line.rsplit(" ", 1)[1])
    return out


def summarize(records: list[Record], wall: float, max_new_tokens: int) -> dict:
    tokens = sum(len(r["token_ids"]) if "token_ids" in r else r["new_tokens"] for r in records)
    itl = [g * 1e3 for r in records for g in (r.get("itl_s") or _gaps(r.get("stamps", [])))]
    return {"requests": len(records), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            "itl_mean_ms": statistics.fmean(itl) if itl else None}


@click.command()
@click.option("--model", default="default", show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads of the in-process engine and of "
              "card-target alone (default: every core)")
@click.option("--trio-target-threads", type=int, default=None,
              help="the trio's card-target --threads (default: `card-client up`'s split)")
@click.option("--sides", default="inprocess,target,trio", show_default=True)
@click.option("--levels", default="1,8", show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--n", "n_prompts", type=int, default=8, show_default=True)
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--prompts", "prompt_file", default="docs/measurements/peer/prompts.jsonl", show_default=True)
@click.option("--http", is_flag=True, help="the services through their OpenAI API instead of gRPC")
@click.option("--baseline-tree", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="another source tree (e.g. `git archive HEAD` before a change): side target-base is "
                   "card-target alone running that tree's code, interleaved with the others")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
def main(model: str, threads: int | None, trio_target_threads: int | None, sides: str, levels: str,
         rounds: int, n_prompts: int, max_new_tokens: int, prompt_file: str, http: bool,
         baseline_tree: Path | None, out: Path) -> None:
    threads = threads or os.cpu_count() or 1
    wanted = [s.strip() for s in sides.split(",") if s.strip()]
    level_list = [int(x) for x in levels.split(",")]
    ds = data.load(f"prompts={prompt_file}", n_prompts, None)
    # as card-client generate and card-target load it (--exact on: the batch-invariant forward),
    # on a passing thread at the forwards' thread count as card-target does (its start-up probes
    # check that count, and no OpenMP pool outlives the load: card.engine.shared.torch_threads)
    config = ModelConfig(spec=model, exact=True)
    loaded = on_passing_thread(lambda: load_model(config), threads, "load-target")
    prompts = [loaded.encode_prompt(p) for p in ds.prompts]
    log_dir = out.with_name(out.stem + "-logs")
    with contextlib.ExitStack() as stack:
        built: list = []
        for side in wanted:
            if side in ("inprocess", "inprocess-thread"):
                built.append(InProcess(loaded, threads, max(8, *level_list), loaded.context_window,
                                       on_thread=side == "inprocess-thread"))
            elif side in ("target", "target-base"):
                if side == "target-base" and baseline_tree is None:
                    raise click.BadParameter("side target-base needs --baseline-tree")
                svc = stack.enter_context(target_alone(model, threads, http, log_dir, side,
                                                       baseline_tree if side == "target-base" else None))
                http_addr = svc.wait_listening(60, HTTP_LISTENING) if http else ""
                built.append(_front(side, http_addr or svc.addr, svc.proc.pid, http, model, svc.metrics_port))
            elif side == "trio":
                trio = stack.enter_context(LocalTrio(
                    target_model=model, draft_model="default", draft_quantize="int8",
                    target_threads=trio_target_threads, log_dir=log_dir / "trio",
                    http_port=0 if http else None, metrics=True))
                addr = trio.http_addr if http else trio.target_addr
                pid = next(p.proc.pid for p in trio.processes if p.name == "card-target")
                built.append(_front("trio", addr, pid, http, model, trio.metrics_ports["card-target"]))
            else:
                raise click.BadParameter(f"unknown side {side}")
        for side in built:  # warm-up
            side.run(prompts[:1], 1, 8)
        results: list[dict] = []
        reference: dict[int, list[int]] = {}
        texts: dict[int, str] = {}
        for rnd in range(rounds):
            for level in level_list:
                shift = (rnd + level) % len(built)
                for side in built[shift:] + built[:shift]:
                    row = {"round": rnd, "side": side.name, "level": level,
                           **measured(side, prompts, level, max_new_tokens)}
                    if side.name == "inprocess":
                        for r in row["records"]:
                            reference.setdefault(r["prompt_index"], r["token_ids"])
                            texts.setdefault(r["prompt_index"], r["text"])
                    results.append(row)
                    cpu, it = row["cpu_ms_per_token"], row.get("iteration_ms", {})
                    click.echo(f"round {rnd} {side.name} x{level}: {row['tok_s']:.2f} tok/s, itl p50 "
                               f"{row['itl_p50_ms']:.1f} ms, cpu ms/token engine {cpu['engine']:.2f} "
                               f"(sys {cpu['engine_sys']:.2f}) "
                               f"serving {cpu['serving']:.2f} client {cpu['client']:.2f}; iteration ms "
                               + " ".join(f"{k} {v:.2f}" for k, v in it.items()), err=True)
    for row in results:  # token ids over gRPC; over HTTP the text (OpenAI streams carry no ids)
        key, want = ("token_ids", reference) if "token_ids" in row["records"][0] else ("text", texts)
        if want:
            row["exact"] = all(r[key] == want.get(r["prompt_index"], r[key]) for r in row["records"])
    for row in results:  # the raw file keeps each request's timings, not its tokens and gaps
        row["records"] = [{"prompt_index": r["prompt_index"], "wall_s": r["wall_s"],
                           "ttft_s": r.get("ttft_s", r["stamps"][0][0] if r.get("stamps") else None),
                           "new_tokens": len(r["token_ids"]) if "token_ids" in r else r.get("new_tokens")}
                          for r in row["records"]]
    table = _table(results, wanted, level_list)
    click.echo(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = report.machine_info({})
    out.write_text(json.dumps({"config": {"model": loaded.name, "threads": threads,
                                          "trio_target_threads": trio_target_threads, "levels": level_list,
                                          "rounds": rounds, "n": len(prompts),
                                          "max_new_tokens": max_new_tokens, "http": http},
                               "machine": machine, "table": table, "rows": results}, indent=1))


def _front(name: str, addr: str, pid: int, http: bool, model: str, metrics_port: int) -> OverGrpc | OverHttp:
    return OverHttp(name, addr, model, pid, metrics_port) if http else OverGrpc(name, addr, pid, metrics_port)


def measured(side: InProcess | OverGrpc | OverHttp, prompts: Sequence[Sequence[int]], level: int,
             max_new_tokens: int) -> dict:
    """One side at one level: the summary, its CPU ms per token (the server's by thread group,
    this process's: the clients, or the in-process engine) and the records."""
    pid = side.pid
    server0 = thread_cpu(pid) if pid else None
    port = getattr(side, "metrics_port", 0)
    phases0 = scrape_phases(port) if port else None
    here0 = time.process_time()
    recs, wall = side.run(prompts, level, max_new_tokens)
    here = time.process_time() - here0
    engine_sys = side.cpu[1] if isinstance(side, InProcess) else 0.0
    engine = side.cpu[0] + engine_sys if isinstance(side, InProcess) else 0.0
    row = summarize(recs, wall, max_new_tokens)
    phases = getattr(side, "phases", None)
    if phases0 is not None:
        after = scrape_phases(port)
        phases = {k: after[k] - phases0[k] for k in after}
    if phases and phases["iterations"]:  # ms per iteration, and iterations per token
        row["iteration_ms"] = {k: phases[k] / phases["iterations"] * 1e3
                               for k in ("plan", "forward", "commit")}
        row["iterations"] = phases["iterations"]
    per = 1e3 / max(row["tokens"], 1)
    if server0 is None or not pid:
        row["cpu_ms_per_token"] = {"engine": engine * per, "engine_sys": engine_sys * per, "serving": 0.0,
                                   "process": here * per, "client": 0.0}
    else:
        server = thread_cpu(pid)
        row["cpu_ms_per_token"] = {k: (server[k] - server0[k]) * per for k in server} | {"client": here * per}
    row["records"] = recs
    return row


def _table(rows: list[dict], sides: list[str], levels: list[int]) -> str:
    """Per level and side: median over rounds of tok/s and ITL p50, and the ratio to in process
    (per round, then the median)."""
    lines = ["| side | in flight | tok/s (median) | x in process | ITL p50 ms | ITL p99 ms | engine CPU "
             "ms/token | serving CPU ms/token | client CPU ms/token | exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for level in levels:
        for side in sides:
            rs = [r for r in rows if r["side"] == side and r["level"] == level]
            if not rs:
                continue
            ratios = []
            for r in rs:
                base = next((b for b in rows if b["side"] == "inprocess" and b["level"] == level
                             and b["round"] == r["round"]), None)
                if base:
                    ratios.append(r["tok_s"] / base["tok_s"])
            lines.append(f"| {side} | {level} | {statistics.median(r['tok_s'] for r in rs):.1f} | "
                         f"{statistics.median(ratios):.3f}x | "
                         f"{statistics.median(r['itl_p50_ms'] for r in rs):.1f} | "
                         f"{statistics.median(r['itl_p99_ms'] for r in rs):.1f} | "
                         f"{statistics.median(r['cpu_ms_per_token']['engine'] for r in rs):.2f} | "
                         f"{statistics.median(r['cpu_ms_per_token']['serving'] for r in rs):.2f} | "
                         f"{statistics.median(r['cpu_ms_per_token']['client'] for r in rs):.2f} | "
                         f"{all(r.get('exact', True) for r in rs)} |" if ratios else
                         f"| {side} | {level} | {statistics.median(r['tok_s'] for r in rs):.1f} | - |"
                         " - | - | - | - | - | - |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
