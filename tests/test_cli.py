"""card-client as a user runs it: the entry point in a subprocess, in-process mode, tiny models."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_models import save_foreign_tokenizer_checkpoint, save_tiny_checkpoint

CLIENT = str(Path(sys.executable).parent / "card-client")

pytestmark = pytest.mark.slow  # card-client as a subprocess, some runs starting a trio


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-models")
    return {
        "target": save_tiny_checkpoint(root / "target", seed=0),
        "draft": save_tiny_checkpoint(root / "draft", seed=0, perturb=0.02),
        "foreign": save_foreign_tokenizer_checkpoint(root / "foreign", seed=0),
    }


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_CLIENT_")}
    return subprocess.run([CLIENT, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def vanilla(models) -> dict:
    """Plain greedy decoding of generate_json's prompt, the reference of several tests (run once)."""
    return generate_json(models, "vanilla")


def generate_json(models: dict[str, Path], mode: str, *extra: str) -> dict:
    proc = run_cli("generate", "Tell me about the sea.", "--inprocess", "--json", "--mode", mode,
                   "--target-model", str(models["target"]), "--draft-model", str(models["draft"]),
                   "--max-new-tokens", "24", "--ignore-eos", *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("sampling", [(), ("--temperature", "0.9", "--top-p", "0.9", "--seed", "11")])
def test_card_and_sd_equal_vanilla_through_the_cli(models, sampling):
    """Tokens, text and --logprobs: the same in every mode, greedy and seeded."""
    want = generate_json(models, "vanilla", *sampling, "--logprobs", "2")
    assert len(want["token_ids"]) == 24 and len(want["logprobs"]) == 24
    for mode in ("card", "sd"):  # --no-backoff: a tiny draft may not pay; here it must run
        out = generate_json(models, mode, *sampling, "--logprobs", "2",
                            *(("--no-backoff",) if mode == "card" else ()))
        assert out["token_ids"] == want["token_ids"], mode
        assert out["text"] == want["text"]
        assert out["stats"]["mode"] == mode
        assert out["stats"]["new_tokens"] == 24
        assert out["stats"]["draft_forwards"] > 0
        for got, ref in zip(out["logprobs"], want["logprobs"], strict=True):
            assert got["token"] == ref["token"] and abs(got["logprob"] - ref["logprob"]) <= 1e-5
            assert [t for t, _ in got["top"]] == [t for t, _ in ref["top"]]


def test_model_free_and_cascade_drafts_equal_vanilla_through_the_cli(models, vanilla):
    for extra in (("--draft-model", "ngram"), ("--cascade", "ngram", "--no-backoff")):
        out = generate_json(models, "card", *extra)
        assert out["token_ids"] == vanilla["token_ids"], extra
    proc = run_cli("generate", "hi", "--inprocess", "--draft-model", "ngram", "--cascade", "ngram")
    assert proc.returncode == 2 and "--cascade" in proc.stderr


def test_streams_text_then_stats_line(models):
    proc = run_cli("generate", "Hello", "--inprocess", "--target-model", str(models["target"]),
                   "--draft-model", str(models["draft"]), "--max-new-tokens", "8", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "no text streamed"
    assert "8 tokens in" in proc.stderr and "mean accepted length" in proc.stderr


def _assert_one_line_error(proc: subprocess.CompletedProcess, code: str, *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("card-client: ")]
    assert len(errors) == 1, proc.stderr
    assert code in errors[0]
    for word in words:
        assert word in errors[0], errors[0]


def test_empty_prompt(models):
    proc = run_cli("generate", "", "--inprocess", "--target-model", str(models["target"]))
    _assert_one_line_error(proc, "INVALID_ARGUMENT", "empty")


def test_prompt_longer_than_context(models):
    proc = run_cli("generate", "word " * 600, "--inprocess", "--no-chat",
                   "--target-model", str(models["target"]), "--mode", "vanilla")
    _assert_one_line_error(proc, "INVALID_ARGUMENT", "context window", "512")


def test_draft_with_another_tokenizer(models):
    proc = run_cli("generate", "hi", "--inprocess", "--target-model", str(models["target"]),
                   "--draft-model", str(models["foreign"]))
    _assert_one_line_error(proc, "FAILED_PRECONDITION", str(models["target"]), str(models["foreign"]))


def test_unknown_model_path(tmp_path):
    proc = run_cli("generate", "hi", "--inprocess", "--target-model", str(tmp_path / "missing.gguf"))
    _assert_one_line_error(proc, "NOT_FOUND", "missing.gguf")


@pytest.mark.parametrize("flags, word", [
    (("--temperature", "-0.5"), "temperature"),
    (("--top-p", "1.5"), "top_p"),
])
def test_bad_sampling_values(models, flags, word):
    proc = run_cli("generate", "hi", "--inprocess", "--target-model", str(models["target"]), *flags)
    _assert_one_line_error(proc, "INVALID_ARGUMENT", word)


@pytest.mark.parametrize("flags", [("--tree-width", "0"), ("--max-chain", "-1"), ("--max-chain", "1000000"),
                                   ("--max-depth", "100000"), ("--min-path-prob", "2"),
                                   ("--verify", "lossy")])
def test_bad_flag_values_are_refused_as_flags(flags):
    """Flags that carry their ranges or choices (card.common.cli.tree_options, --verify): click
    refuses them before anything loads, naming the flag (in process: nothing here imports a model)."""
    from click.testing import CliRunner

    from card.client.cli import cli

    result = CliRunner().invoke(cli, ["generate", "hi", "--inprocess", *flags])
    assert result.exit_code == 2, result.output  # click's usage error, no traceback
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    assert "Invalid value" in result.output and flags[0] in result.output


@pytest.mark.parametrize("flags, word", [(("--logprobs", "21"), "logprobs"),
                                         (("--verify", "loose", "--loose-window", "1"), "window")])
def test_bad_verify_and_logprobs_values_are_one_line(flags, word):
    proc = run_cli("generate", "hi", "--inprocess", *flags)
    _assert_one_line_error(proc, "INVALID_ARGUMENT", word)


def test_unreachable_target_is_one_line():
    import socket

    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_cli("generate", "hi", "--target", f"127.0.0.1:{port}", timeout=120)
    _assert_one_line_error(proc, "UNAVAILABLE", f"127.0.0.1:{port}")


# every field of TreeParams, by the service flag that carries it
_DRAFT_FLAGS = {"width": "tree_width", "branch": "branch", "max_depth": "max_depth"}
_CACHE_FLAGS = {"max_chain": "max_chain", "min_path_prob": "min_path_prob", "b_extension": "b_extension"}


def test_every_tree_field_reaches_a_service():
    """service_args (the one place a TreeParams becomes service flags) covers every field, and the
    services' own command lines parse each back to the value it was given."""
    from card.cache_service.server import main as cache_main
    from card.client.trio import service_args
    from card.draft_service.server import main as draft_main
    from card.engine.shared.config import TreeParams

    assert {f.name for f in dataclasses.fields(TreeParams)} == {*_DRAFT_FLAGS, *_CACHE_FLAGS}
    for tree in (TreeParams(width=5, branch=2, max_depth=3, max_chain=1, b_extension=False,
                            min_path_prob=0.25),
                 TreeParams(width=1, branch=0, max_depth=12, max_chain=0, b_extension=True)):
        args = service_args(tree)
        draft = draft_main.make_context("card-draft", [*args["draft"], "--cache", "127.0.0.1:1"]).params
        cache = cache_main.make_context("card-cache", list(args["cache"])).params
        for field, param in _DRAFT_FLAGS.items():
            assert draft[param] == getattr(tree, field), field
        for field, param in _CACHE_FLAGS.items():
            assert cache[param] == getattr(tree, field), field


def test_tree_flags_reach_a_local_trio(models, vanilla):
    """--max-chain 1 caps every verification at the next token plus one drafted token; --exact off
    reaches the trio's card-target, whose stats say so (the tiny fp32 model's tokens stay the same:
    at its width the vendor kernels agree with the exact ones)."""
    proc = run_cli("generate", "Tell me about the sea.", "--json", "--target-model", str(models["target"]),
                   "--draft-model", str(models["target"]), "--max-new-tokens", "24", "--ignore-eos",
                   "--max-chain", "1", "--tree-width", "2", "--exact", "off", timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == vanilla["token_ids"]
    assert max(out["stats"]["accepted_lengths"]) <= 2, out["stats"]
    assert out["stats"]["exact"] is False


def test_exact_off_marks_the_stats_in_process(models, vanilla):
    assert vanilla["stats"]["exact"] is True
    out = generate_json(models, "card", "--exact", "off", "--no-backoff")
    assert out["stats"]["exact"] is False


def test_draft_shape_flags_are_refused_with_a_running_target():
    proc = run_cli("generate", "hi", "--target", "127.0.0.1:1", "--tree-width", "2", "--max-depth", "4")
    _assert_one_line_error(proc, "INVALID_ARGUMENT", "--tree-width", "--max-depth", "card-draft")


def test_generate_without_services_starts_a_local_trio(models, vanilla):
    """The README's main job: no target configured, so generate brings up a trio for itself; the
    acceptance rule and logprobs travel over gRPC (loose with its gate closed is exact)."""
    proc = run_cli("generate", "Tell me about the sea.", "--json", "--target-model", str(models["target"]),
                   "--draft-model", str(models["draft"]), "--max-new-tokens", "24", "--ignore-eos",
                   "--verify", "loose", "--loose-entropy-threshold", "5", "--logprobs", "1", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "starting a local trio" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == vanilla["token_ids"]
    assert out["stats"]["mode"] == "card"
    assert out["stats"]["exact"] is True  # through the trio, the stats travel over gRPC
    assert out["stats"]["verify"] == "loose" and out["stats"]["lossy"] and out["stats"]["loose_kept"] == 0
    assert [lp["token"] for lp in out["logprobs"]] == vanilla["token_ids"]


def test_export_turns_a_gguf_into_a_checkpoint_with_the_same_outputs(tmp_path, smollm2_gguf):
    gguf = smollm2_gguf
    dest = tmp_path / "smollm2"
    proc = run_cli("export", str(gguf), str(dest))
    assert proc.returncode == 0, proc.stderr
    assert (dest / "config.json").is_file() and list(dest.glob("*.safetensors"))
    outputs = []
    for spec in (gguf, dest):
        proc = run_cli("generate", "Name three colours.", "--inprocess", "--json", "--mode", "vanilla",
                       "--target-model", str(spec), "--max-new-tokens", "12", "--ignore-eos")
        assert proc.returncode == 0, proc.stderr
        outputs.append(json.loads(proc.stdout)["token_ids"])
    assert outputs[0] == outputs[1]
    again = run_cli("export", str(gguf), str(dest))  # never overwrites
    assert again.returncode == 2 and "not empty" in again.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("redis-server") is None,
                    reason="parent-death signal is Linux's; needs redis-server")
def test_a_local_trio_does_not_outlive_the_process_that_started_it(tmp_path) -> None:
    """The starter is SIGKILLed (as the OOM killer does): what it started goes with it."""
    code = ("import sys, time; from pathlib import Path; from card.client.trio import LocalTrio; "
            "t = LocalTrio(log_dir=Path(sys.argv[1])); t._start_redis(); print(t.redis.pid, flush=True); "
            "time.sleep(600)")
    starter = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    redis_pid = int(starter.stdout.readline())
    os.kill(redis_pid, 0)  # alive
    starter.kill()
    starter.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(redis_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(redis_pid, signal.SIGKILL)
    pytest.fail("redis-server outlived the process that started it")


def test_the_key_and_the_request_limits_are_flags_and_variables():
    """card-client and card-bench present a target's key from a flag or their variable; card-target's
    guard and limits are flags with CARD_TARGET_* variables, shown in --help."""
    from click.testing import CliRunner

    from card.client.bench.cli import main as bench
    from card.client.cli import cli
    from card.target_service.server import main as target

    runner = CliRunner()
    for command, args, variables in (
            (cli, ["generate", "--help"], ["CARD_CLIENT_API_KEY"]),
            (bench, ["--help"], ["CARD_BENCH_API_KEY"]),
            (target, ["--help"], ["CARD_TARGET_API_KEY", "CARD_TARGET_HTTP_TLS_CERT",
                                  "CARD_TARGET_HTTP_TLS_KEY", "CARD_TARGET_MAX_BODY_MB",
                                  "CARD_TARGET_HTTP_METRICS", "CARD_TARGET_MAX_WAITING",
                                  "CARD_TARGET_QUEUE_TIMEOUT_S"])):
        page = runner.invoke(command, args, terminal_width=200).output
        assert "--api-key" in page or command is target
        for name in variables:
            assert name in page, (args, name)


# ---- issue 36: the flags a vLLM user reads ----------------------------------------------------
def _commands() -> dict[str, object]:
    """Every command of the project by its name on a command line, subcommands included."""
    import click

    from card.cache_service.server import main as cache
    from card.client.bench.cli import main as bench
    from card.client.cli import cli
    from card.draft_service.server import main as draft
    from card.target_service.server import main as target

    found: dict[str, object] = {"card-target": target, "card-draft": draft, "card-cache": cache,
                                "card-bench": bench}

    def walk(name: str, command: click.Command) -> None:
        found[name] = command
        for sub, child in getattr(command, "commands", {}).items():
            walk(f"{name} {sub}", child)

    walk("card-client", cli)
    return found


def test_every_flag_of_every_command_reads_a_variable_shown_in_its_help():
    """The README's rule: CARD_<PROGRAM>_<OPTION> for every flag (card-client export alone takes
    none); each --help line names it. A variable that is read is read as the flag (negative:
    CARD_CLIENT_TIMEOUT=0 is refused like --timeout 0)."""
    import click
    from click.testing import CliRunner

    from card.client.cli import cli

    missing = []
    for name, command in _commands().items():
        if name == "card-client export":
            continue
        ctx = click.Context(command, info_name=name, **command.context_settings)
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                record = param.get_help_record(ctx)
                prefix = "CARD_" + name.split()[0].removeprefix("card-").upper() + "_"
                if record is None or f"env var: {prefix}" not in record[1]:
                    missing.append(f"{name} {param.opts[0]}")
    assert not missing, missing
    result = CliRunner().invoke(cli, ["generate", "hi", "--inprocess"], env={"CARD_CLIENT_TIMEOUT": "0"})
    assert result.exit_code == 2 and "--timeout" in result.output


def test_no_help_paragraph_repeats_across_the_commands():
    """A flag shared by many commands keeps its --help short (the explanation is in docs/usage.md):
    no help text over 100 characters appears in more than three commands."""
    import collections

    import click

    where: dict[str, list[str]] = collections.defaultdict(list)
    for name, command in _commands().items():
        for param in command.params:
            if isinstance(param, click.Option) and param.help and len(param.help) > 100:
                where[param.help].append(name)
    repeated = {text[:60]: names for text, names in where.items() if len(names) > 3}
    assert not repeated, repeated


def test_help_pages_say_what_was_missing():
    """card-bench lists its service modes and datasets; drafts prints no RST markup; --exact
    gives the measured cost, not "a little faster"; generate has the --timeout its deadline names."""
    import re

    from click.testing import CliRunner

    from card.client.bench import data
    from card.client.bench.cli import main as bench
    from card.client.bench.modes import MODE_NAMES
    from card.client.cli import cli

    runner = CliRunner()

    def page(command: object, *args: str) -> str:
        text = runner.invoke(command, [*args, "--help"], terminal_width=100).output  # type: ignore[arg-type]
        return re.sub(r"\s+", " ", re.sub(r"-\n\s+", "-", text))  # words click wrapped, joined again

    bench_page = page(bench)
    for name in [*data.KNOWN, *(m for m in MODE_NAMES if m.startswith("svc-"))]:
        assert name in bench_page, name
    for args in (["drafts"], ["drafts", "drain"], ["drafts", "weights"], ["drafts", "resume"]):
        assert "``" not in page(cli, *args), args
    exact = page(cli, "generate")
    assert "0.34x (32)" in exact and "a little faster" not in exact
    assert "--timeout" in exact


def test_a_missed_deadline_names_the_timeout_flag():
    """A target that takes the connection and never answers: generate --timeout 1 ends in one line
    naming the deadline and the flag that raises it."""
    import socket

    with socket.socket() as s:  # accepts connections (the kernel's backlog), never speaks HTTP/2
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        proc = run_cli("generate", "hi", "--target", f"127.0.0.1:{port}", "--timeout", "1", timeout=120)
    _assert_one_line_error(proc, "UNAVAILABLE", "--timeout")
    assert "1s deadline" in proc.stderr


def test_the_readme_maps_vllm_serve_flags_to_card_target_flags_that_exist():
    """The README's vLLM table: every flag it names for card-target is one of card-target's."""
    import re

    from card.target_service.server import main as target

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Coming from `vllm serve`", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
    vllm = {flag for row in rows for flag in re.findall(r"--[a-z-]+", row[0])}
    ours = {flag for row in rows for cell in re.findall(r"`([^`]*)`", row[1])
            for flag in re.findall(r"--[a-z-]+", cell)}
    assert {"--model", "--served-model-name", "--host", "--port", "--api-key", "--max-model-len",
            "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens", "--dtype", "--seed",
            "--speculative-config", "--tensor-parallel-size", "--enable-prefix-caching",
            "--chat-template", "--disable-log-requests"} <= vllm
    flags = {opt for param in target.params for opt in (*param.opts, *param.secondary_opts)}
    assert ours and not ours - flags, ours - flags


def test_a_constraint_holds_and_card_equals_vanilla_through_the_cli(models, tmp_path):
    """--constraint (structured outputs): the output matches it, card's equals plain decoding's;
    a schema from a file; a constraint that does not compile is one line naming the problem."""
    import re

    regex = ("--constraint", "regex=[0-9]{3}-[a-z]{2,5}")
    plain, card = generate_json(models, "vanilla", *regex), generate_json(models, "card", *regex)
    assert card["token_ids"] == plain["token_ids"]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", plain["text"]), plain["text"]
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                  "required": ["ok"], "additionalProperties": False}))
    answer = generate_json(models, "card", "--constraint", f"json_schema=@{schema}")
    assert json.loads(answer["text"]) in ({"ok": True}, {"ok": False})
    proc = run_cli("generate", "hi", "--inprocess", "--target-model", str(models["target"]),
                   "--constraint", "regex=([a-z")
    _assert_one_line_error(proc, "INVALID_ARGUMENT", "regex")
    proc = run_cli("generate", "hi", "--inprocess", "--constraint", "yaml")
    assert proc.returncode == 2 and "KIND=TEXT" in proc.stderr


def _imports_transformers(module: str) -> bool:
    code = f"import sys, {module}; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_the_client_starts_without_importing_transformers() -> None:
    """transformers' import is most of a cold start (~5 of card-client's 9 s on the project's VM);
    the client needs it only for in-process runs and exports, which import it when they run. The
    in-process runner, which does need it, is the control that the check can see it."""
    assert not _imports_transformers("card.client.cli")
    assert _imports_transformers("card.engine.inprocess.runner")
