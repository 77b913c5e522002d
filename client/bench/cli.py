"""card-bench: the same prompts through every decoding mode, on one machine, in one run.

    card-bench --target-model T.gguf --draft-model D.gguf --dataset gsm8k --n 10 --max-new-tokens 128

Fair by construction: every mode gets the same prompt token ids (chat template applied once), the
models are loaded once and shared, every mode is warmed up first, modes are interleaved prompt by
prompt with a rotating order (so load from other processes and thermal drift hit every mode
alike), and each mode runs with its best thread setting (one-model-at-a-time modes get every core;
card splits them between target and draft). Greedy outputs must equal vanilla token for token:
any difference is printed and makes the command exit with status 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import torch

from card.client.bench import data, load, report
from card.client.bench.modes import (
    DEFAULT_SERVICE_MODES,
    MODE_NAMES,
    SERVICE_POOLS,
    SVC_CARD,
    SVC_VANILLA,
    VANILLA,
    BenchMode,
    BuiltMode,
    ModeSettings,
    ServiceMode,
    build_mode,
    step_ms_by_threads,
)
from card.client.options import default_thread_split
from card.client.trio import LocalTrio, service_args
from card.common.cli import (
    cpu_attention_option,
    cpu_linear_option,
    exact_option,
    exit_on_error,
    ngram_options,
    option,
    tls_options,
)
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.loading.cpu_linear import PackedLinear, pack_linears
from card.engine.loading.models import DTYPES, LoadedModel, ModelConfig, load_model
from card.engine.shared.config import (
    NGRAM,
    DrafterKind,
    NgramConfig,
    SamplingParams,
    TreeParams,
    Verify,
    VerifyPolicy,
    default_tree_params,
)
from card.engine.shared.errors import InvalidArgument
from card.engine.target.drafting_policy import SPECULATION_MODES

EXIT_MISMATCH = 1


def bench_trees(device_type: str, overrides: Mapping[str, Any]) -> tuple[TreeParams, TreeParams]:
    """The neural modes' tree and the n-gram modes' tree (the model-free depth and chain), each
    the hardware default for ``device_type`` with the flags given over it."""
    return (default_tree_params(device_type).with_overrides(**overrides),
            default_tree_params(device_type, DrafterKind.NGRAM).with_overrides(**overrides))


def randomized(draft: LoadedModel, seed: int) -> LoadedModel:
    """The draft's architecture and tokenizer with random weights: a useless draft of equal cost."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    dtype = next(p.dtype for p in draft.model.parameters() if p.is_floating_point())
    model = AutoModelForCausalLM.from_config(draft.model.config, dtype=dtype).eval()
    if any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in draft.model.modules()):
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    elif any(isinstance(m, PackedLinear) for m in draft.model.modules()):
        pack_linears(model)
    return LoadedModel(f"random-init {draft.name} (seed {seed})", model, draft.tokenizer,
                       draft.fingerprint, draft.eos_ids, draft.context_window)


@contextlib.contextmanager
def _trio(target_model: str, draft_model: str, dtype: str, draft_quantize: str, tree: TreeParams,
          settings: ModeSettings, modes: Sequence[BenchMode] = DEFAULT_SERVICE_MODES,
          cpu_linear: str = "auto", cpu_attention: str = "auto") -> Iterator[LocalTrio]:
    """The services, configured like the in-process card modes (tree shape, chain policy, n-gram
    settings, threads): the draft model's worker in pool bench-draft and, for svc-ngram and
    svc-cascade, a model-free and a cascade worker in pools of their own (SERVICE_POOLS), so that
    every service mode runs on one trio, each naming its pool."""
    with LocalTrio(
        target_model=target_model, draft_model=draft_model, draft_quantize=draft_quantize, dtype=dtype,
        target_threads=settings.target_threads, draft_threads=settings.draft_threads, tree=tree,
        exact=settings.exact, ngram=settings.ngram,
        extra_args={"draft": ["--pool", SERVICE_POOLS[DrafterKind.NEURAL], "--cpu-linear", cpu_linear],
                    # its own drafts: rejection modes (+rejection) run as asked, not exactly
                    "target": ["--speculation", settings.speculation, "--allow-rejection",
                               "--cpu-linear", cpu_linear, "--cpu-attention", cpu_attention]},
    ) as trio:
        more = []
        drafters = {m.drafter for m in modes}
        if DrafterKind.NGRAM in drafters:  # the model-free depth, as card-ngram runs in process
            tree_args = service_args(settings.ngram_tree or tree)["draft"]
            more.append(trio.start_draft(NGRAM, args=[*tree_args, "--pool", SERVICE_POOLS[DrafterKind.NGRAM]],
                                         wait=False))
        if DrafterKind.CASCADE in drafters:
            more.append(trio.start_draft(draft_model, draft_quantize, wait=False, args=[
                "--cascade", NGRAM, "--pool", SERVICE_POOLS[DrafterKind.CASCADE]]))
        for proc in more:
            proc.wait_listening(trio.start_timeout_s)
            proc.wait_serving(trio.start_timeout_s)
        yield trio


def run_bench(target: LoadedModel, draft: LoadedModel | None, modes: list[BuiltMode],
              datasets: list[data.Dataset], max_new_tokens: int, warmup_tokens: int,
              progress: bool = True) -> list[dict]:
    """Every prompt through every mode (order rotating per prompt); one record per run."""
    from tqdm import tqdm

    encoded = [(ds, [target.encode_prompt(p) for p in ds.prompts]) for ds in datasets]
    if warmup_tokens:
        first = encoded[0][1][0]
        for mode in modes:
            mode.run(first, min(warmup_tokens, max_new_tokens))
    records: list[dict] = []
    total = sum(len(ids) for _, ids in encoded) * len(modes)
    with tqdm(total=total, disable=not progress, unit="run", dynamic_ncols=True, file=sys.stderr) as bar:
        for ds, prompts in encoded:
            for i, prompt_ids in enumerate(prompts):
                shift = i % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    bar.set_postfix_str(f"{ds.name} #{i} {mode.name}")
                    out = mode.run(prompt_ids, max_new_tokens)
                    reference = ds.reference(i)
                    correct = data.answer_correct(target.decode(out.token_ids), reference)
                    records.append({**out.stats.to_dict(), "dataset": ds.name, "prompt_index": i,
                                    "mode": mode.name, "finish_reason": out.finish_reason,
                                    "token_ids": out.token_ids, "reference": reference, "correct": correct})
                    bar.update(1)
    return records


def _in_process_modes(requested: Sequence[BenchMode], variants: Mapping[str, TreeParams],
                      policies: Sequence[VerifyPolicy]) -> list[BenchMode]:
    """vanilla first (speedups and exactness are measured against it), the requested modes and each
    --card-variant, every card mode named for no acceptance rule once under each of ``policies``."""
    if any(m.services for m in requested):
        raise InvalidArgument("svc-* modes run through the services alone (--modes svc-...,svc-... "
                              "--services); beside in-process modes --services adds svc-vanilla, svc-card")
    for m in requested:
        if m.variant and m.variant not in variants:
            raise InvalidArgument(f"mode {m} names no --card-variant {m.variant} "
                                  f"(the modes: {', '.join(MODE_NAMES)})")
    base = [VANILLA, *requested, *(BenchMode("card", DrafterKind.NEURAL, variant=v) for v in variants)]
    if len(policies) > 1 and not any(m.speculates for m in base):
        raise InvalidArgument("--verify with more than one rule compares card modes: add card to --modes")
    return list(dict.fromkeys(
        run for m in base
        for run in ([dataclasses.replace(m, verify=p.mode) for p in policies]
                    if m.speculates and m.verify is Verify.EXACT else [m])))


_TREE_FIELDS = {f.name: f.type for f in dataclasses.fields(TreeParams)}


def _parse_variant(value: str) -> tuple[str, dict[str, object]]:
    """``NAME:FIELD=VALUE,...`` -> (NAME, {field: value}) over card.engine.shared.config.TreeParams."""
    name, sep, spec = value.partition(":")
    if not sep or not name.strip() or not spec.strip():
        raise InvalidArgument(f"--card-variant wants NAME:FIELD=VALUE[,...], got {value!r}")
    try:
        BenchMode("card", DrafterKind.NEURAL, variant=name.strip())
    except InvalidArgument as e:
        raise InvalidArgument(f"--card-variant {name.strip()}: {e}") from None
    fields: dict[str, object] = {}
    for item in spec.split(","):
        key, eq, raw = (part.strip() for part in item.partition("="))
        if not eq or key not in _TREE_FIELDS:
            raise InvalidArgument(f"--card-variant {name}: {item.strip()!r} is not FIELD=VALUE, "
                                  f"FIELD one of {', '.join(_TREE_FIELDS)}")
        kind = _TREE_FIELDS[key]
        try:
            if kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(raw)
                fields[key] = raw.lower() in ("true", "1", "yes")
            else:
                fields[key] = int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise InvalidArgument(f"--card-variant {name}: {key} wants a {kind}, got {raw!r}") from None
    return name.strip(), fields


@click.command(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "CARD_BENCH"})
@option("--target-model", default="default", show_default=True,
        help="target model spec: HF id, checkpoint folder, .gguf file, or 'default'")
@option("--draft-model", default="default", show_default=True, help="draft model spec")
@option("--target-dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True)
@option("--draft-dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True)
@option("--draft-quantize", type=click.Choice(["none", "int8"]), default="int8", show_default=True,
        help="dynamic int8 Linear layers for the draft (CPU)")
@option("--prepack/--no-prepack", default=True, show_default=True,
        help="oneDNN-prepacked Linear weights for fp32 models on the CPU "
             "(card.engine.loading.cpu_linear)")
@cpu_linear_option()
@cpu_attention_option()
@option("--draft-random-init", type=int, default=None, metavar="SEED",
        help="replace the draft's weights by random ones (seeded): the useless-draft worst case")
@option("--modes", default="vanilla,sd,card,hf,hf-assisted", show_default=True,
        help=f"comma-separated, from {', '.join(MODE_NAMES)}; a card mode also as MODE+POLICY "
             "(an acceptance rule, as --verify); vanilla is always run: it is the reference")
@option("--dataset", "datasets", multiple=True, default=(), envvar="CARD_BENCH_DATASET",
        help=f"{' | '.join(data.KNOWN)} | name=path | path to a jsonl(.gz); repeatable "
             "(default: gsm8k, unless --prompts)")
@option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
        envvar=data.ENV_DATA_DIR, show_envvar=True,
        help=f"read the named datasets from {', '.join(f'DIR/{path}' for path in data.KNOWN.values())} "
             "(default: the copies packaged with card-bench; GSM8K's holds the first 200 of 1,319 "
             "prompts)")
@option("--prompts", "prompt_files", multiple=True, metavar="FILE", envvar="CARD_BENCH_PROMPTS",
        type=click.Path(dir_okay=False, exists=True, path_type=Path),
        help="your own prompts: a JSONL(.gz) file, one prompt per line (a JSON string, or an object "
             "with messages, turns, conversations, question, prompt, text, or instruction/input); "
             "repeatable, used instead of the default dataset; --n of each")
@option("--n", "n_prompts", type=click.IntRange(min=1), default=10, show_default=True, envvar="CARD_BENCH_N",
        help="first N prompts of each dataset")
@option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@option("--tree-width", type=click.IntRange(1, 64), default=None,
        help="K (card); default 3 on CPU, 4 on GPU (card.engine.shared.config.default_tree_params)")
@option("--branch", type=click.IntRange(0, 64), default=None, help="k, secondary children per node")
@option("--max-depth", type=click.IntRange(min=1), default=None, help="tree depth cap (card)")
@option("--max-chain", type=click.IntRange(min=0), default=None, help="verify length cap (card)")
@option("--b-extension/--no-b-extension", default=None, help="extend chains from tier B (card)")
@option("--min-path-prob", type=click.FloatRange(0.0, 1.0), default=None,
        help="card: cut chains where the draft's prefix probability falls below this "
             "(default 0: never)")
@option("--card-variant", "card_variants", multiple=True, metavar="NAME:FIELD=VALUE[,...]",
        envvar="CARD_BENCH_CARD_VARIANT",
        help="also run in-process card with these tree settings as mode card-NAME, interleaved "
             "with the others (e.g. k2:width=2,max_depth=10); repeatable")
@option("--backoff/--no-backoff", default=True, show_default=True,
        help="card: pause a draft that keeps missing or makes the target slower than alone")
@option("--speculation", type=click.Choice(SPECULATION_MODES), default="auto", show_default=True,
        help="the target's speculation controller, in process and in the trio's card-target: auto "
             "(speculate where it measurably pays at the load), always, never (every draft paused)")
@option("--gamma", type=click.IntRange(min=1), default=4, show_default=True, help="sd chain length")
@option("--threads", type=click.IntRange(min=1), default=None,
        help="threads for one-model modes (default: the count, up to every core, whose plain "
             "decoding step measured fastest before the run)")
@option("--target-threads", type=click.IntRange(min=1), default=None, help="card target threads")
@option("--draft-threads", type=click.IntRange(min=1), default=None, help="card draft threads")
@option("--ignore-eos", is_flag=True, help="always generate --max-new-tokens tokens")
@option("--warmup-tokens", type=click.IntRange(min=0), default=8, show_default=True,
        help="tokens of the first prompt each mode generates before timing starts")
@option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="JSON results (default bench-results/bench-<time>.json)")
@option("--chart", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="PNG chart (default: the JSON path with .png)")
@option("--services", is_flag=True,
        help="also run svc-vanilla and svc-card through a local trio (redis, card-cache, card-draft, "
             "card-target subprocesses loading the same models)")
@option("--concurrency", default=None, metavar="N,N,...",
        help="with --services: closed-loop load, N clients each sending every prompt back to back, "
             "through the trio (svc-vanilla and svc-card at each N); --modes svc-vanilla,svc-card "
             "runs only that, loading no model in this process")
@option("--target", "target_addr", default=None, envvar="CARD_BENCH_TARGET_ADDR", show_envvar=True,
        help="with --services and only svc-* modes: load this running card-target (HOST:PORT) instead "
             "of starting a local trio; the model flags then only label the results")
@option("--api-key", default=None, envvar="CARD_BENCH_API_KEY", show_envvar=True,
        help="with --target: the key of that card-target (its --api-key), presented on every call")
@option("--temperature", type=click.FloatRange(0.0, 100.0), default=0.0, show_default=True,
        help="every mode samples at this temperature with --seed (0: greedy); sampled outputs of "
             "exact modes still equal vanilla's token for token")
@option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="sampling seed")
@option("--verify", "verify_policies", default="exact", show_default=True, metavar="POLICY,...",
        envvar="CARD_BENCH_VERIFY",
        help="acceptance rules of the card modes: exact, rejection (speculative sampling on drawn "
             "chains; needs --temperature > 0), loose (FLy, lossy); the card modes run under each, "
             "named MODE+POLICY past exact, so they compare in one run")
@option("--loose-entropy-threshold", type=float, default=None,
        help="verify loose: FLy's top-3 entropy gate (default 0.3)")
@option("--loose-window", type=int, default=None, help="verify loose: FLy's window (default 6)")
@option("--no-progress", is_flag=True, help="no progress bar")
@tls_options("card-bench", serves=False, envvar_prefix="CARD_BENCH")
@ngram_options("card-bench", envvar_prefix="CARD_BENCH")
@exact_option("CARD_BENCH")
def main(**opts: Any) -> None:  # click's values, typed by bench's signature
    """Compare decoding modes on the same prompts, on this machine, in one run: in process (vanilla,
    sd, card and its drafters, transformers' hf modes), through a local trio (--services adds
    svc-vanilla and svc-card; svc-* modes alone load no model here), or under load (--concurrency;
    --target for a running card-target). Every option also reads CARD_BENCH_<OPTION>."""
    with exit_on_error("card-bench"):
        code = bench(**opts)
    sys.exit(code)


def bench(*, target_model: str, draft_model: str, target_dtype: str, draft_dtype: str, draft_quantize: str,
          prepack: bool, cpu_linear: str, draft_random_init: int | None, modes: str,
          cpu_attention: str = "auto",
          datasets: tuple[str, ...],
          prompt_files: tuple[Path, ...] = (),
          data_dir: Path | None, n_prompts: int, max_new_tokens: int, tree_width: int | None,
          branch: int | None, max_depth: int | None, max_chain: int | None, b_extension: bool | None,
          min_path_prob: float | None, card_variants: tuple[str, ...], backoff: bool, gamma: int,
          speculation: str = "auto",
          ignore_eos: bool, threads: int | None, target_threads: int | None, draft_threads: int | None,
          warmup_tokens: int, out: Path | None, chart: Path | None, services: bool, concurrency: str | None,
          no_progress: bool, target_addr: str | None = None, tls: TlsConfig = PLAINTEXT,
          ngram: NgramConfig | None = None, exact: bool = True, api_key: str | None = None,
          temperature: float = 0.0, seed: int = 0, verify_policies: str = "exact",
          loose_entropy_threshold: float | None = None, loose_window: int | None = None) -> int:
    ngram = ngram or NgramConfig()
    sampling = SamplingParams(temperature=temperature, seed=seed)
    policies = _parse_policies(verify_policies, loose_entropy_threshold, loose_window)
    levels = _parse_levels(concurrency)
    if levels and not services:
        raise InvalidArgument("--concurrency loads the services: add --services")
    requested = list(dict.fromkeys(BenchMode.parse(m) for m in modes.split(",") if m.strip()))
    services_only = bool(requested) and all(m.services for m in requested)
    cores = os.cpu_count() or 1
    split = default_thread_split(cores)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = dict(width=tree_width, branch=branch, max_depth=max_depth, max_chain=max_chain,
                     b_extension=b_extension, min_path_prob=min_path_prob)
    tree, ngram_tree = bench_trees(device_type, overrides)
    variants = {name: tree.with_overrides(**fields) for name, fields in map(_parse_variant, card_variants)}
    settings = ModeSettings(tree=tree, gamma=gamma, all_threads=threads or cores,  # measured below
                            target_threads=target_threads or split[0],
                            draft_threads=draft_threads or split[1],
                            ignore_eos=ignore_eos, backoff=backoff, speculation=speculation,
                            ngram=ngram, ngram_tree=ngram_tree, variants=variants,
                            exact=exact, sampling=sampling, verify=policies[0])
    specs = [*datasets, *(f"{data.resolve(str(f))[0]}={f}" for f in prompt_files)] or ["gsm8k"]
    loaded = [data.load(spec, n_prompts, data_dir) for spec in specs]
    if target_addr and not services_only:
        raise InvalidArgument("--target loads a running card-target: only svc-* modes run there "
                              "(--modes svc-vanilla,svc-card --services)")
    if services_only:
        if not services:
            raise InvalidArgument(f"--modes {modes} runs through the services: add --services")
        if (not sampling.greedy or len(policies) > 1 or policies[0].mode is not Verify.EXACT
                or any(m.verify is not Verify.EXACT for m in requested)):
            raise InvalidArgument("--modes svc-* alone measures greedy, exact load; --temperature and "
                                  "--verify go with the in-process modes (add vanilla,card)")
        return _services_only(target_model, draft_model, target_dtype, draft_quantize, tree, settings,
                              requested, loaded, levels or (1,), max_new_tokens, ignore_eos, out,
                              target_addr, tls, api_key or None)
    runs = _in_process_modes(requested, variants, policies)

    t0 = time.perf_counter()
    target = load_model(ModelConfig(spec=target_model, dtype=target_dtype, prepack=prepack, exact=exact,
                                     cpu_linear=cpu_linear, cpu_attention=cpu_attention))
    draft = None
    if any(m.needs_draft for m in runs):
        draft = load_model(ModelConfig(spec=draft_model, dtype=draft_dtype, quantize=draft_quantize,
                                       prepack=prepack, cpu_linear=cpu_linear))
        if draft_random_init is not None:
            draft = randomized(draft, draft_random_init)
    click.echo(f"loaded target {target.name} and draft {draft.name if draft else '-'} "
               f"in {time.perf_counter() - t0:.1f}s", err=True)
    step_ms: dict[int, float] = {}
    if threads is None and cores > 1:  # plain decoding gets its best thread count, measured
        step_ms = step_ms_by_threads(target.model, cores)
        settings = dataclasses.replace(settings, all_threads=min(step_ms, key=step_ms.__getitem__))
        steps = ", ".join(f"{t} threads {ms:.1f} ms" for t, ms in step_ms.items())
        click.echo(f"one-model modes on {settings.all_threads} thread(s) (decoding step: {steps})", err=True)

    with contextlib.ExitStack() as stack:
        built: list[BuiltMode] = []
        for m in runs:
            built.append(build_mode(m, target, draft, settings))
            stack.callback(built[-1].close)
        if services:
            if draft_random_init is not None:
                raise InvalidArgument("--services loads the draft from its spec; drop --draft-random-init")
            if not prepack:
                raise InvalidArgument("the services always prepack CPU weights; drop --no-prepack")
            trio = stack.enter_context(_trio(target_model, draft_model, target_dtype, draft_quantize, tree,
                                             settings, cpu_linear=cpu_linear,
                                             cpu_attention=cpu_attention))
            card_threads = {"target": settings.target_threads, "draft": settings.draft_threads}
            svc = [SVC_VANILLA, *(dataclasses.replace(SVC_CARD, verify=p.mode) for p in policies)]
            built += [ServiceMode(m, trio.target_addr, card_threads, ignore_eos, sampling, policies[0])
                      for m in svc]
        records = run_bench(target, draft, built, loaded, max_new_tokens, warmup_tokens,
                            progress=not no_progress)
        if levels:
            prompts = [target.encode_prompt(p) for ds in loaded for p in ds.prompts]
            load_records, load_rows = load.run_load(trio.target_addr, DEFAULT_SERVICE_MODES, prompts, levels,
                                                    max_new_tokens, ignore_eos, log=_echo_err)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = out or Path("bench-results") / f"bench-{stamp}.json"
    config = {
        "target_model": target.name, "draft_model": draft.name if draft else None,
        "target_dtype": target_dtype, "draft_dtype": draft_dtype, "draft_quantize": draft_quantize,
        "draft_random_init": draft_random_init, "prepack": prepack, "cpu_linear": cpu_linear,
        "cpu_attention": cpu_attention, "exact": exact,
        "modes": [m.name for m in built],
        "datasets": {d.name: str(d.path) for d in loaded}, "n": n_prompts,
        "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos, "tree": vars(tree) | {"k": tree.k},
        "card_variants": {f"card-{name}": vars(variant) for name, variant in variants.items()},
        "one_model_threads": settings.all_threads, "step_ms_by_threads": step_ms,
        "backoff": backoff, "speculation": speculation, "gamma": gamma, "warmup_tokens": warmup_tokens,
        "ngram": vars(ngram), "ngram_tree": vars(ngram_tree),
        "greedy": sampling.greedy, "temperature": temperature, "seed": seed,
        "verify": [{"mode": p.mode.value, "entropy_threshold": p.entropy_threshold, "window": p.window}
                   for p in policies],
    }
    machine = report.machine_info({m.name: m.threads for m in built})
    how = "greedy" if sampling.greedy else f"temperature {temperature:g}, seed {seed}"
    title = (f"{target.name} / draft {draft.name if draft else '-'}; {max_new_tokens} new tokens, "
             f"{how}; {machine['cpu_model']} x{cores}")
    code = finish(records, config, machine, out, chart or out.with_suffix(".png"), title)
    if levels:
        code = max(code, _finish_load(load_records, load_rows, config, machine, out, title))
    return code


def _parse_policies(value: str, entropy_threshold: float | None, window: int | None) -> list[VerifyPolicy]:
    """``exact,loose`` -> the acceptance rules, in order, each once."""
    base = VerifyPolicy()
    names = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip())) or ["exact"]
    threshold = base.entropy_threshold if entropy_threshold is None else entropy_threshold
    size = base.window if window is None else window
    return [VerifyPolicy(Verify.parse(n), threshold, size) for n in names]


def _parse_levels(value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        levels = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        raise InvalidArgument(f"--concurrency wants N,N,... (positive integers), got {value!r}") from None
    if not levels or levels[0] < 1:
        raise InvalidArgument(f"--concurrency wants positive integers, got {value!r}")
    return levels


def _echo_err(line: str) -> None:
    click.echo(line, err=True)


def _services_only(target_model: str, draft_model: str, target_dtype: str, draft_quantize: str,
                   tree: TreeParams, settings: ModeSettings, modes: list[BenchMode],
                   loaded: list[data.Dataset],
                   levels: tuple[int, ...], max_new_tokens: int, ignore_eos: bool, out: Path | None,
                   target_addr: str | None = None, tls: TlsConfig = PLAINTEXT,
                   api_key: str | None = None) -> int:
    """The load through the services alone: no model in this process (text prompts; the target
    applies its chat template), svc-vanilla always run as the reference. ``target_addr``: a running
    card-target (dialed with ``tls``, presenting ``api_key``) instead of a local trio."""
    modes = list(dict.fromkeys([load.REFERENCE, *modes]))
    prompts = [p for ds in loaded for p in ds.prompts]
    own_pools = [m.name for m in modes if m.drafter in (DrafterKind.NGRAM, DrafterKind.CASCADE)]
    if target_addr and own_pools:
        raise InvalidArgument(f"{', '.join(own_pools)} run on drafts card-bench starts; with --target, name "
                              f"the running target's pools in your own requests (svc-card there is unnamed)")
    with contextlib.ExitStack() as stack:
        addr = target_addr or stack.enter_context(
            _trio(target_model, draft_model, target_dtype, draft_quantize, tree, settings, modes)).target_addr
        records, rows = load.run_load(addr, modes, prompts, levels, max_new_tokens, ignore_eos,
                                      log=_echo_err, tls=tls, api_key=api_key,
                                      pools={} if target_addr else SERVICE_POOLS)
    config = {"target_model": target_model, "draft_model": draft_model, "draft_quantize": draft_quantize,
              "exact": settings.exact, "modes": [m.name for m in modes],
              "datasets": {d.name: str(d.path) for d in loaded},
              "n": len(prompts),
              "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos, "tree": vars(tree),
              "target_threads": settings.target_threads, "draft_threads": settings.draft_threads,
              "target_addr": target_addr or "local trio",
              "speculation": "the running target's" if target_addr else settings.speculation}
    threads = {"target": settings.target_threads, "draft": settings.draft_threads}
    machine = report.machine_info({m.name: threads for m in modes})
    out = out or Path("bench-results") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    title = (f"{target_model} / draft {draft_model}; {max_new_tokens} new tokens, greedy; "
             f"{machine['cpu_model']}")
    return _finish_load(records, rows, config, machine, out, title)


def _finish_load(records: list[dict], rows: list[dict], config: dict, machine: dict, out: Path,
                 title: str) -> int:
    click.echo(load.table(rows))
    path = out.with_name(out.stem + "-load.json")
    report.write_json(path, {"config": config, "machine": machine, "summary": rows, "records": records})
    _write_chart(load.write_chart, path, path.with_suffix(".png"), rows, title)
    bad = [r for r in records if r["matches_reference"] is False]
    if bad:
        click.echo(f"card-bench: {len(bad)} output(s) under load differ from the same prompt served alone",
                   err=True)
        return EXIT_MISMATCH
    return 0


def _write_chart(draw: Callable[..., None], out: Path, chart: Path, *args: object) -> None:
    """Draw the chart beside the JSON ``out`` (already written); without matplotlib, one line on stderr
    says how to get it, and the run goes on (its exit status does not change)."""
    hint = report.try_chart(draw, chart, *args)
    if hint:
        click.echo(f"wrote {out}", err=True)
        click.echo(hint, err=True)
    else:
        click.echo(f"wrote {out} and {chart}", err=True)


def finish(records: list[dict], config: dict, machine: dict, out: Path, chart: Path, title: str) -> int:
    """Check exactness, print the table and any mismatch, write JSON and chart; the exit status."""
    bad = report.check_exactness(records)
    rows = report.summarize(records)
    click.echo(report.table(rows))
    for line in report.mismatch_lines(bad):
        click.echo(line)
    report.write_json(out, {"config": config, "machine": machine, "summary": rows,
                                  "records": records, "mismatches": len(bad)})
    _write_chart(report.write_chart, out, chart, rows, records, title)
    if bad:
        click.echo(f"card-bench: {len(bad)} output(s) differ from vanilla", err=True)
        return EXIT_MISMATCH
    return 0


if __name__ == "__main__":
    main()
