"""Benchmark prompts: GSM8K, HumanEval and MT-Bench in their published jsonl formats, and the
input-grounded sets derived from them (card.client.bench.derived).

A dataset is named (``gsm8k``, ``humaneval``, ``mt_bench``, ``code_edit``, ``mt_bench_followup``)
or given as ``name=path`` / a path to any jsonl(.gz) file whose records carry ``messages`` (a chat:
the follow-up set), ``question`` (GSM8K), ``prompt`` (HumanEval, code_edit) or ``turns``
(MT-Bench, first turn). A named dataset is read from a data directory (card-bench ``--data-dir``,
else ``$CARD_BENCH_DATA_DIR``), else from the samples packaged in ``client/bench/datasets`` (GSM8K: the
first 200 of 1,319 test records; HumanEval and MT-Bench whole; see its README.md).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from card.engine.shared.errors import InvalidArgument, NotFound

PACKAGED = Path(__file__).resolve().parent / "datasets"
ENV_DATA_DIR = "CARD_BENCH_DATA_DIR"
KNOWN = {
    "gsm8k": Path("gsm8k") / "test.jsonl",
    "humaneval": Path("humaneval") / "HumanEval.jsonl.gz",
    "mt_bench": Path("mt_bench") / "question.jsonl",
    "code_edit": Path("code_edit") / "code_edit.jsonl",
    "mt_bench_followup": Path("mt_bench_followup") / "question.jsonl",
}
SAMPLED = frozenset({"gsm8k"})  # packaged as a sample of the published set, not whole


@dataclass(frozen=True)
class Dataset:
    """``references``: per prompt, the reference answer a generation can be scored against (GSM8K's
    final number), or None."""

    name: str
    path: Path
    prompts: tuple[str | list[dict], ...]  # text, or a chat's messages
    references: tuple[str | None, ...] = ()

    def reference(self, i: int) -> str | None:
        return self.references[i] if i < len(self.references) else None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def reference_of(record: object) -> str | None:
    """GSM8K's final answer (after ``####``), normalised; None for records without one."""
    answer = record.get("answer") if isinstance(record, dict) else None
    if not isinstance(answer, str) or "####" not in answer:
        return None
    return _normalise(answer.rsplit("####", 1)[1].strip())


def _normalise(number: str) -> str:
    value = number.replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


def answer_correct(text: str, reference: str | None) -> bool | None:
    """Whether the last number in ``text`` is the reference (GSM8K's usual scoring); None when
    there is no reference."""
    if reference is None:
        return None
    numbers = _NUMBER.findall(text)
    return bool(numbers) and _normalise(numbers[-1]) == reference


def data_dir(override: str | Path | None = None) -> Path:
    """Where named datasets are read: ``override`` (--data-dir), else $CARD_BENCH_DATA_DIR, else
    the package."""
    chosen = override or os.environ.get(ENV_DATA_DIR)
    return Path(chosen).expanduser() if chosen else PACKAGED


def resolve(spec: str, directory: str | Path | None = None) -> tuple[str, Path]:
    """``gsm8k`` | ``name=path`` | ``path`` -> (name, path)."""
    if "=" in spec:
        name, _, where = spec.partition("=")
        return name, Path(where).expanduser()
    if spec in KNOWN:
        return spec, data_dir(directory) / KNOWN[spec]
    path = Path(spec).expanduser()
    return path.name.split(".")[0], path


PROMPT_KEYS = ("question", "prompt", "text", "instruction", "input")


def prompt_of(record: object) -> str | list[dict]:
    """The user prompt of one record (a chat's messages for records that carry them), whichever
    of the formats it is in: a JSON string; OpenAI ``messages``; MT-Bench ``turns`` (the first);
    ShareGPT ``conversations`` (the first human turn); or a string under one of PROMPT_KEYS
    (GSM8K, HumanEval, most prompt dumps, Alpaca's ``instruction`` with its ``input`` after it)."""
    if isinstance(record, str) and record:
        return record
    if not isinstance(record, dict):
        raise InvalidArgument(f"a record is neither a string nor an object: {str(record)[:60]}")
    if isinstance(record.get("messages"), list) and record["messages"]:
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in record["messages"]]
    if isinstance(record.get("turns"), list) and record["turns"]:
        return str(record["turns"][0])
    if isinstance(record.get("conversations"), list):
        human = [value for t in record["conversations"] if isinstance(t, dict)
                 and t.get("from") in ("human", "user") and isinstance(value := t.get("value"), str)]
        if human:
            return human[0]
    instruction, extra = record.get("instruction"), record.get("input")
    if isinstance(instruction, str) and isinstance(extra, str) and extra:
        return f"{record['instruction']}\n\n{record['input']}"
    for key in PROMPT_KEYS:
        if isinstance(value := record.get(key), str) and value:
            return value
    raise InvalidArgument(f"a record has none of 'messages', 'turns', 'conversations', "
                          f"{', '.join(repr(k) for k in PROMPT_KEYS)}: keys {sorted(record)}")


def load(spec: str, n: int | None = None, directory: str | Path | None = None) -> Dataset:
    """The first ``n`` prompts (all when None) of a dataset, in file order so every run sees the
    same prompts. Fewer than ``n`` in the file: one line on stderr, and the ones there are."""
    name, path = resolve(spec, directory)
    if not path.is_file():
        where = f"; a data directory holds it as {KNOWN[spec].as_posix()}" if spec in KNOWN else ""
        raise NotFound(f"dataset {spec!r}: {path} does not exist (give gsm8k, humaneval, mt_bench, "
                       f"name=path or a path to a jsonl file{where})")
    opener = gzip.open if path.suffix == ".gz" else open
    prompts: list[str | list[dict]] = []
    references: list[str | None] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if n is not None and len(prompts) >= n:
                break
            if line.strip():
                record = json.loads(line)
                prompts.append(prompt_of(record))
                references.append(reference_of(record))
    if not prompts:
        raise InvalidArgument(f"dataset {spec!r} ({path}) holds no prompts")
    if n is not None and len(prompts) < n:
        if spec in SAMPLED and path.is_relative_to(PACKAGED):
            note = f"the packaged sample has {len(prompts)} prompts; --data-dir DIR for the full set"
        else:
            note = f"{path} has {len(prompts)} prompts, fewer than the {n} asked for"
        print(f"{name}: {note}", file=sys.stderr)
    return Dataset(name, path, tuple(prompts), tuple(references))
