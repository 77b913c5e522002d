"""card-bench end to end on tiny checkpoints, and its exactness check on a wrong output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from card.client.bench import load, report
from card.client.bench.cli import main
from tests.tiny_models import save_tiny_checkpoint

# tests that load models take the `pair` fixture (tiny checkpoints with the default model's tokenizer,
# tests.tiny_models); the others need no model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    target = save_tiny_checkpoint(root / "target", seed=0)
    draft = save_tiny_checkpoint(root / "draft", seed=0, perturb=0.02)
    return target, draft


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bench_end_to_end(pair, tmp_path):
    target, draft = pair
    gsm = _jsonl(tmp_path / "g.jsonl", [{"question": "What is 2 + 3?", "answer": "5"},
                                        {"question": "Name a colour.", "answer": "red"}])
    mt = _jsonl(tmp_path / "m.jsonl", [{"turns": ["Say hi.", "again"]}, {"turns": ["Count to 3."]}])
    out, chart = tmp_path / "r.json", tmp_path / "r.png"
    result = CliRunner().invoke(main, [
        "--target-model", str(target), "--draft-model", str(draft), "--draft-quantize", "none",
        "--dataset", f"gsm8k={gsm}", "--dataset", f"mt_bench={mt}", "--n", "2", "--max-new-tokens", "8",
        "--modes", "vanilla,sd,card,hf,hf-assisted", "--tree-width", "2", "--max-depth", "4",
        "--ignore-eos", "--out", str(out), "--chart", str(chart), "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert chart.is_file() and chart.read_bytes()[:4] == b"\x89PNG"
    records = payload["records"]
    assert len(records) == 2 * 2 * 5  # datasets x prompts x modes
    assert all(r["matches_vanilla"] for r in records)
    # --ignore-eos: every mode uses the whole budget
    assert all(r["new_tokens"] == 8 and r["finish_reason"] == "length" for r in records)
    # interleaved with a rotating order: the first mode differs between consecutive prompts
    firsts = [next(r["mode"] for r in records if r["dataset"] == "gsm8k" and r["prompt_index"] == i)
              for i in (0, 1)]
    assert firsts[0] != firsts[1]
    summary = {(row["dataset"], row["mode"]): row for row in payload["summary"]}
    assert summary[("gsm8k", "vanilla")]["speedup_vs_vanilla"] == pytest.approx(1.0)
    assert summary[("gsm8k", "card")]["mean_accepted_length"] >= 1.0
    assert payload["machine"]["cpu_count"] >= 1 and payload["machine"]["threads"]["card"]["draft"] >= 1
    # one-model modes run on the thread count whose decoding step measured fastest
    step_ms = {int(t): ms for t, ms in payload["config"]["step_ms_by_threads"].items()}
    if payload["machine"]["cpu_count"] > 1:
        assert payload["config"]["one_model_threads"] == min(step_ms, key=step_ms.__getitem__)
        assert payload["machine"]["threads"]["vanilla"]["target"] == payload["config"]["one_model_threads"]
    assert "card" in result.output and "hf-assisted" in result.output


def test_bench_samples_and_compares_acceptance_rules_in_one_run(pair, tmp_path):
    """--temperature/--seed sample in every mode (exact card still equals vanilla); --verify
    exact,loose adds card+loose, reported lossy, never a failed exactness check; GSM8K answers are
    scored against their references."""
    target, draft = pair
    gsm = _jsonl(tmp_path / "g.jsonl", [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
                                        {"question": "Name a colour.", "answer": "#### 1,000"}])
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, [
        "--target-model", str(target), "--draft-model", str(draft), "--draft-quantize", "none",
        "--dataset", f"gsm8k={gsm}", "--n", "2", "--max-new-tokens", "24", "--modes", "vanilla,card",
        "--temperature", "0.8", "--seed", "4", "--verify", "exact,loose", "--loose-window", "2",
        "--loose-entropy-threshold", "0", "--ignore-eos", "--out", str(out), "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    modes = {r["mode"] for r in payload["records"]}
    assert modes == {"vanilla", "card", "card+loose"}
    for r in payload["records"]:
        assert r["reference"] in ("5", "1000") and r["correct"] in (True, False)
        assert r["verify"] == ("loose" if r["mode"] == "card+loose" else "exact")
        if r["mode"] == "card":
            assert r["matches_vanilla"], "sampled exact card equals sampled vanilla"
    summary = {row["mode"]: row for row in payload["summary"]}
    assert summary["card+loose"]["lossy"] and not summary["card"]["lossy"]
    assert summary["vanilla"]["accuracy"] is not None
    assert payload["config"]["temperature"] == 0.8 and not payload["config"]["greedy"]
    # HF's greedy modes cannot sample: refused in one line, not run greedily beside sampled ones
    refused = CliRunner().invoke(main, ["--target-model", str(target), "--modes", "vanilla,hf",
                                        "--temperature", "0.5", "--dataset", f"gsm8k={gsm}", "--n", "1"])
    assert refused.exit_code != 0 and "--temperature 0" in refused.output
    no_card = CliRunner().invoke(main, ["--target-model", str(target), "--modes", "vanilla", "--verify",
                                        "exact,loose", "--dataset", f"gsm8k={gsm}", "--n", "1"])
    assert no_card.exit_code != 0 and "add card to --modes" in no_card.output


def test_bench_through_services(pair, tmp_path):
    """--services: the same prompts through a real local trio (redis, cache, draft, target)."""
    target, draft = pair
    data = _jsonl(tmp_path / "g.jsonl", [{"question": "What is 2 + 3?"}])
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, [
        "--target-model", str(target), "--draft-model", str(draft), "--draft-quantize", "none",
        # 256 tokens: a tiny model commits 64 faster than a loaded machine's cache answers the open
        # (a late session catches up; it needs tokens left to step), and the test wants Steps
        "--dataset", f"gsm8k={data}", "--n", "1", "--max-new-tokens", "256", "--modes", "vanilla",
        "--services", "--ignore-eos", "--out", str(out), "--no-progress", "--warmup-tokens", "2",
    ])
    assert result.exit_code == 0, result.output
    records = {r["mode"]: r for r in json.loads(out.read_text())["records"]}
    assert set(records) == {"vanilla", "svc-vanilla", "svc-card"}
    assert records["svc-card"]["token_ids"] == records["vanilla"]["token_ids"]
    assert records["svc-card"]["matches_vanilla"] and records["svc-vanilla"]["matches_vanilla"]
    assert records["svc-card"]["step_rtt_ms"], "the target reports its Step round trips"


def test_load_through_the_services_alone(pair, tmp_path):
    """--modes svc-vanilla,svc-card,svc-ngram --concurrency on --prompts of several formats:
    closed-loop clients through a real trio (the model-free worker in a pool of its own beside the
    draft model's), every output compared with the same prompt served alone; no model loaded in
    card-bench itself."""
    target, draft = pair
    turns = [{"from": "human", "value": "Count to five."}]
    data = _jsonl(tmp_path / "mine.jsonl",
                  ["What is 2 + 3?", {"text": "Name a colour."}, {"conversations": turns},
                   {"messages": [{"role": "user", "content": "Hi."},
                                 {"role": "assistant", "content": "Hello."},
                                 {"role": "user", "content": "Say it again."}]}])
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, [
        "--target-model", str(target), "--draft-model", str(draft), "--draft-quantize", "none",
        "--prompts", str(data), "--n", "4", "--max-new-tokens", "8",
        "--modes", "svc-vanilla,svc-card,svc-ngram",
        "--services", "--concurrency", "1,3", "--ignore-eos", "--out", str(out),
        # the speculative paths are what is measured here (the controller's own test is
        # tests/services/test_speculation_control.py); its setting reaches the trio's target
        "--speculation", "always",
    ])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "r.json").exists()  # no in-process run
    payload = json.loads((tmp_path / "r-load.json").read_text())
    assert payload["config"]["datasets"] == {"mine": str(data)}
    assert payload["config"]["speculation"] == "always"
    rows = {(r["mode"], r["concurrency"]): r for r in payload["summary"]}
    assert set(rows) == {(m, c) for m in ("svc-vanilla", "svc-card", "svc-ngram") for c in (1, 3)}
    assert rows[("svc-ngram", 3)]["requests"] == 12 and rows[("svc-ngram", 1)]["hit_rate"] is not None
    assert rows[("svc-card", 3)]["requests"] == 12 and rows[("svc-vanilla", 1)]["requests"] == 4
    assert all(r["matches_reference"] for r in payload["records"])
    assert all(r["new_tokens"] == 8 and r["ttft_s"] > 0 for r in payload["records"])
    assert rows[("svc-vanilla", 3)]["x_vs_one_at_a_time"] > 0
    assert rows[("svc-vanilla", 1)]["mean_accepted_length"] == 1.0  # no speculation: one token a forward
    assert rows[("svc-vanilla", 1)]["hit_rate"] is None and rows[("svc-card", 1)]["hit_rate"] is not None
    assert (tmp_path / "r-load.png").stat().st_size > 0
    assert "ttft p50" in result.output


def test_card_variants_run_interleaved_under_their_own_names(pair, tmp_path):
    target, draft = pair
    data = _jsonl(tmp_path / "g.jsonl", [{"question": "What is 2 + 3?"}, {"question": "Name a colour."}])
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, [
        "--target-model", str(target), "--draft-model", str(draft), "--draft-quantize", "none",
        "--dataset", f"gsm8k={data}", "--n", "2", "--max-new-tokens", "6", "--modes", "vanilla",
        "--card-variant", "k2:width=2,max_depth=3",
        "--card-variant", "nob:b_extension=false,min_path_prob=0.5",
        "--ignore-eos", "--out", str(out), "--no-progress", "--warmup-tokens", "0",
    ])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["config"]["card_variants"]["card-k2"]["width"] == 2
    assert payload["config"]["card_variants"]["card-k2"]["max_depth"] == 3
    assert payload["config"]["card_variants"]["card-nob"]["b_extension"] is False
    assert payload["config"]["card_variants"]["card-nob"]["min_path_prob"] == 0.5
    modes = {r["mode"] for r in payload["records"]}
    assert modes == {"vanilla", "card-k2", "card-nob"}
    assert all(r["matches_vanilla"] for r in payload["records"])
    summary = {row["mode"]: row for row in payload["summary"]}
    assert summary["card-k2"]["draft_idle_fraction"] is not None


@pytest.mark.parametrize("variant", ["k2", "k2:", "k2:width", "k2:depth=3", "k2:width=two", "ngram:width=2",
                                     "k2:b_extension=maybe"])
def test_a_malformed_card_variant_is_a_usage_error(variant):
    result = CliRunner().invoke(main, ["--card-variant", variant, "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "--card-variant" in result.output


def test_wrong_output_is_reported():
    records = [
        {"dataset": "d", "prompt_index": 0, "mode": "vanilla", "token_ids": [5, 6, 7]},
        {"dataset": "d", "prompt_index": 0, "mode": "card", "token_ids": [5, 9, 7]},
        {"dataset": "d", "prompt_index": 0, "mode": "sd", "token_ids": [5, 6]},
        {"dataset": "d", "prompt_index": 0, "mode": "hf", "token_ids": [5, 6, 7]},
    ]
    bad = report.check_exactness(records)
    assert [r["mode"] for r in bad] == ["card", "sd"]
    assert bad[0]["mismatch"] == {"position": 1, "expected": 6, "got": 9}
    assert bad[1]["mismatch"] == {"position": 2, "expected": 7, "got": None}
    lines = report.mismatch_lines(bad)
    assert "prompt 0 mode card: first differing position 1, vanilla token 6, card token 9" in lines[0]


def record(mode, tokens):
    """One card-bench record, as run_bench makes it, without running a model."""
    from card.engine.shared.stats import GenerationStats

    stats = GenerationStats(mode=mode, new_tokens=len(tokens), wall_s=0.5, target_forwards=len(tokens),
                            accepted_lengths=[1] * len(tokens))
    return {"dataset": "d", "prompt_index": 0, "mode": mode, "token_ids": tokens, **stats.to_dict()}


def test_mismatch_exits_non_zero(tmp_path, capsys):
    """finish() (the tail of every card-bench run) returns a failing status on a wrong output."""
    from card.client.bench.cli import EXIT_MISMATCH, finish

    good = [record("vanilla", [5, 6, 7]), record("card", [5, 6, 7])]
    args = ({}, {"cpu_count": 2}, tmp_path / "r.json", tmp_path / "r.png", "t")
    assert finish([dict(r) for r in good], *args) == 0
    assert finish([*good, record("sd", [5, 6, 8])], *args) == EXIT_MISMATCH
    out = capsys.readouterr().out
    assert "MISMATCH d prompt 0 mode sd: first differing position 2, vanilla token 7, sd token 8" in out
    assert json.loads((tmp_path / "r.json").read_text())["mismatches"] == 1


@pytest.fixture
def no_matplotlib(monkeypatch):
    """`import matplotlib` (and matplotlib.pyplot) fails as where the bench extra is not installed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)


def test_without_matplotlib_the_run_succeeds_and_says_how_to_get_the_chart(tmp_path, capsys, no_matplotlib):
    from card.client.bench.cli import finish

    out, chart = tmp_path / "r.json", tmp_path / "r.png"
    records = [record("vanilla", [5, 6, 7]), record("card", [5, 6, 7])]
    assert finish(records, {}, {"cpu_count": 2}, out, chart, "t") == 0
    assert json.loads(out.read_text())["mismatches"] == 0
    assert not chart.exists()
    captured = capsys.readouterr()
    assert "vanilla" in captured.out  # the table
    # the JSON's line, then the one line on how to get the chart
    assert captured.err.splitlines()[-2:] == [f"wrote {out}", report.chart_hint(chart)]
    assert "matplotlib is not installed" in report.chart_hint(chart)
    assert "pip install 'card-serving[bench]'" in report.chart_hint(chart)
    assert "Traceback" not in captured.err
    # the --concurrency chart goes the same way
    rows = [{"mode": "svc-vanilla", "concurrency": 1, "tokens_per_s": 3.0}]
    assert report.try_chart(load.write_chart, tmp_path / "l.png", rows, "t") == report.chart_hint(
        tmp_path / "l.png")
    assert not (tmp_path / "l.png").exists()


def test_only_a_missing_matplotlib_is_forgiven(tmp_path):
    def needs_pil(path, *args):
        raise ModuleNotFoundError("No module named 'PIL'", name="PIL")

    with pytest.raises(ModuleNotFoundError):
        report.try_chart(needs_pil, tmp_path / "c.png")

    def broken(path, *args):
        raise ValueError("bad rows")

    with pytest.raises(ValueError):
        report.try_chart(broken, tmp_path / "c.png")


def test_with_matplotlib_the_chart_is_drawn(tmp_path, capsys):
    """The control: the same call draws the PNG where matplotlib is installed."""
    pytest.importorskip("matplotlib")
    from card.client.bench.cli import finish

    out, chart = tmp_path / "r.json", tmp_path / "r.png"
    assert finish([record("vanilla", [5, 6, 7]), record("card", [5, 6, 7])], {}, {"cpu_count": 2}, out, chart,
                  "t") == 0
    assert chart.read_bytes()[:4] == b"\x89PNG"
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"wrote {out} and {chart}"
    assert report.chart_hint(chart) not in err


def test_peer_side_by_side_writes_aiperf_prompts_and_reports_ratios(tmp_path):
    """card.client.bench.peer: prompts as AIPerf single_turn lines with the token budget; an AIPerf
    export summarized; two servers' reports in one table, the second as a ratio of the first."""
    from card.client.bench import peer

    texts = peer.write_prompts("mt_bench:2,gsm8k:1", 64, tmp_path / "p.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and [x["text"] for x in lines] == texts
    assert all(x["output_length"] == 64 and x["text"] for x in lines)
    export = {"output_token_throughput": {"avg": 150.0}, "request_throughput": {"avg": 2.0},
              "time_to_first_token": {"p50": 300.0, "p90": 900.0},
              "inter_token_latency": {"p50": 40.0, "p90": 50.0}, "request_count": {"avg": 16}}
    row = peer.summarize(export)
    assert row == {"output_tok_s": 150.0, "requests_s": 2.0, "ttft_ms": 300.0, "ttft_p90_ms": 900.0,
                   "itl_ms": 40.0, "itl_p90_ms": 50.0, "requests": 16, "errors": 0}
    for label, tok_s in (("vllm", 150.0), ("trio", 75.0)):
        (tmp_path / f"{label}.json").write_text(json.dumps(
            {"label": label, "levels": {"8": {**row, "output_tok_s": tok_s}}}))
    result = CliRunner().invoke(peer.main, ["report", str(tmp_path / "vllm.json"),
                                            str(tmp_path / "trio.json")])
    assert result.exit_code == 0, result.output
    assert "| trio | 8 | 75.0 | 0.50x |" in result.output and "| vllm | 8 | 150.0 | 1.00x |" in result.output


def test_peer_reads_the_servers_own_metrics_from_a_real_aiperf_export():
    """AIPerf 0.13's server_metrics_export.json of a run against card-target's front (unedited, in
    docs/measurements/aiperf-metrics/): the server's TTFT and ITL and vLLM's acceptance figures,
    computed from the scraped card_target_* families; a vLLM-named page reads alike; a server that
    exports no speculation metrics gets no acceptance columns."""
    from card.client.bench import peer

    path = Path(__file__).parents[1] / "docs/measurements/aiperf-metrics/server_metrics_export-c1.json"
    export = json.loads(path.read_text())
    families = export["metrics"]
    total = {c: families[f"card_target_{c}"]["series"][0]["stats"]["total"] for c in peer.SPEC_COUNTERS}
    row = peer.server_side(export)
    accepted, drafted, drafts = (total[c] for c in peer.SPEC_COUNTERS)
    assert drafted > 0 and drafts > 0
    assert row["acceptance_rate"] == accepted / drafted
    assert row["mean_acceptance_length"] == 1 + accepted / drafts
    ttft = families["card_target_time_to_first_token_seconds"]["series"][0]["stats"]["p50_estimate"]
    assert row["server_ttft_ms"] == 1000 * ttft > 0 and row["server_itl_ms"] > 0
    # the same page under vLLM's names (counters keep AIPerf's name, with or without _total)
    def vllm(name: str) -> str:
        return name.replace("card_target_", "vllm:") + ("_total" if "num_draft_tokens" in name else "")

    renamed = {"metrics": {vllm(name): family for name, family in families.items()}}
    assert peer.server_side(renamed) == row
    # negative control: no spec_decode families, no acceptance
    plain = {"metrics": {n: f for n, f in families.items() if "spec_decode" not in n}}
    assert set(peer.server_side(plain)) == {"server_ttft_ms", "server_itl_ms"}


def test_ngram_modes_grow_the_ngram_tree():
    """card-ngram / svc-ngram run the model-free depth and chain, not the neural tree's (a string
    where the drafter kind belongs once made them run the neural tree silently)."""
    from card.client.bench.cli import bench_trees
    from card.engine.shared.config import NGRAM_CHAIN, NGRAM_DEPTH

    for device_type in ("cpu", "cuda"):
        tree, ngram_tree = bench_trees(device_type, {"width": None, "max_depth": None})
        assert ngram_tree.max_depth == NGRAM_DEPTH != tree.max_depth
        assert ngram_tree.max_chain == max(tree.max_chain, NGRAM_CHAIN)
        assert ngram_tree.width == tree.width


def test_every_mode_name_parses_once_and_names_itself_again():
    """The card-bench grammar, [svc-]DECODER[-DRAFTER | -VARIANT][+POLICY], parsed into one
    BenchMode whose name is the text it came from."""
    from card.client.bench.modes import MODE_NAMES, BenchMode
    from card.engine.shared.config import DrafterKind, Verify

    for name in (*MODE_NAMES, "card-k2", "card-k2+loose", "svc-ngram+rejection", "card-auto+loose"):
        assert BenchMode.parse(name).name == name
    assert BenchMode.parse("svc-ngram") == BenchMode("card", DrafterKind.NGRAM, services=True)
    assert BenchMode.parse("hf-pld") == BenchMode("hf", DrafterKind.NGRAM)
    assert BenchMode.parse(" card-k2+loose ") == BenchMode("card", DrafterKind.NEURAL, variant="k2",
                                                            verify=Verify.LOOSE)
    assert [m.needs_draft for m in map(BenchMode.parse, ("sd", "card-ngram", "hf-assisted", "svc-card"))] == [
        True, False, True, False]


@pytest.mark.parametrize("text", ["card2", "svc-sd", "hf+loose", "sd+rejection", "card+", "card+lossy",
                                  "svc-card-k2", "card-a b", "card-ngram-x+y+z"])
def test_a_mode_outside_the_grammar_is_a_usage_error(text):
    from card.client.bench.modes import BenchMode
    from card.engine.shared.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        BenchMode.parse(text)
    result = CliRunner().invoke(main, ["--modes", f"vanilla,{text}", "--no-progress"])
    assert result.exit_code == 2 and "card-bench" in result.output, result.output


def test_card_modes_run_once_under_each_acceptance_rule():
    """--verify: every card mode of the run (variants too) under each rule, named MODE+POLICY
    past exact; vanilla first; a card-NAME mode needs its --card-variant."""
    from card.client.bench.cli import _in_process_modes
    from card.client.bench.modes import BenchMode
    from card.engine.shared.config import TreeParams, Verify, VerifyPolicy
    from card.engine.shared.errors import InvalidArgument

    exact, loose = VerifyPolicy(), VerifyPolicy(Verify.LOOSE)
    requested = [BenchMode.parse(m) for m in ("sd", "card-ngram", "hf")]
    names = [m.name for m in _in_process_modes(requested, {"k2": TreeParams()}, [exact, loose])]
    assert names == ["vanilla", "sd", "card-ngram", "card-ngram+loose", "hf", "card-k2", "card-k2+loose"]
    assert [m.name for m in _in_process_modes([BenchMode.parse("card")], {}, [loose])] == ["vanilla",
                                                                                          "card+loose"]
    with pytest.raises(InvalidArgument, match="--card-variant k3"):
        _in_process_modes([BenchMode.parse("card-k3")], {"k2": TreeParams()}, [exact])
    with pytest.raises(InvalidArgument, match="add card to --modes"):
        _in_process_modes([BenchMode.parse("sd")], {}, [exact, loose])
    with pytest.raises(InvalidArgument, match="services alone"):
        _in_process_modes([BenchMode.parse("svc-card")], {}, [exact])


def test_the_quiet_client_reads_the_servers_view_between_two_metrics_pages():
    """card.client.bench.quiet.server_view: the movement between two /metrics pages, card-target's
    names or vLLM's: TTFT and ITL p50 from the buckets that moved (linear inside the bucket, as
    histogram_quantile), acceptance from the spec_decode counters; a page without them gives no
    acceptance (the negative control), and what happened before the first page does not count."""
    from card.client.bench.quiet import server_view

    def page(prefix: str, ttft: dict[float, int], accepted: int, drafted: int, drafts: int,
             spec: bool = True) -> str:
        lines = [f"# TYPE {prefix}time_to_first_token_seconds histogram"]
        lines += [f'{prefix}time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {n}'
                  for le, n in ttft.items()]
        total = max(ttft.values())
        lines += [f'{prefix}time_to_first_token_seconds_count{{model_name="m"}} {total}',
                  f'{prefix}time_to_first_token_seconds_sum{{model_name="m"}} {0.1 * total}']
        if spec:
            for name, value in (("accepted_tokens", accepted), ("draft_tokens", drafted), ("drafts", drafts)):
                lines += [f"# TYPE {prefix}spec_decode_num_{name} counter",
                          f'{prefix}spec_decode_num_{name}_total{{model_name="m"}} {value}']
        return "\n".join(lines) + "\n"

    for prefix in ("card_target_", "vllm:"):
        # before: 10 requests all under 0.1 s; between the pages 4 more: 2 under 0.1, 2 in (0.1, 0.5]
        before = page(prefix, {0.1: 10, 0.5: 10, float("inf"): 10}, 50, 100, 40)
        after = page(prefix, {0.1: 12, 0.5: 14, float("inf"): 14}, 80, 140, 50)
        row = server_view(before, after)
        assert row["server_ttft_ms"] == pytest.approx(100.0)  # the median of the 4: the 2nd of them
        assert row["acceptance_rate"] == pytest.approx(30 / 40)
        assert row["mean_acceptance_length"] == pytest.approx(1 + 30 / 10)
        plain = server_view(page(prefix, {0.1: 1, 0.5: 3, float("inf"): 3}, 0, 0, 0, spec=False),
                            page(prefix, {0.1: 1, 0.5: 7, float("inf"): 7}, 0, 0, 0, spec=False))
        assert set(plain) == {"server_ttft_ms"} and 100.0 < plain["server_ttft_ms"] < 500.0
