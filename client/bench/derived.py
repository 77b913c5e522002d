"""Input-grounded prompt sets, derived from the packaged ones (the text to be produced is largely
in the prompt: where model-free drafting pays).

    code_edit            HumanEval's canonical solutions, each with an instruction to change it
                         and return the whole function (a copy with edits)
    mt_bench_followup    MT-Bench's second turns, after the first turn and an answer to it: the
                         follow-up works on the first turn's text (rewrite, shorten, extend it)

The files under client/bench/datasets are this module's output, rebuilt with

    python -m card.client.bench.derived --answer-model /path/to/qwen2.5-coder-0.5b [--questions 24]

(code_edit needs no model; the follow-up set needs first-turn answers, generated greedily by
``--answer-model`` with the engine's plain decoding and recorded beside each record).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import click

from card.client.bench.data import KNOWN, PACKAGED
from card.engine.shared.config import Mode

CODE_EDIT = Path("code_edit") / "code_edit.jsonl"
FOLLOWUP = Path("mt_bench_followup") / "question.jsonl"

# Edits that keep most of the function: the answer is mostly a copy of the prompt's code
EDITS = (
    "Add a short comment above each line of the function body. Return the complete function.",
    "Rename the function's local variables to longer, more descriptive names. Return the complete "
    "function.",
    "Add type hints to the signature and keep everything else unchanged. Return the complete function.",
    "Add a check at the top of the function that raises ValueError on invalid input. Return the "
    "complete function.",
)


def code_edit_records(humaneval: Path) -> Iterator[dict]:
    """One record per HumanEval problem: its prompt and canonical solution, and an edit to make."""
    with gzip.open(humaneval, "rt", encoding="utf-8") as f:
        for i, line in enumerate(line for line in f if line.strip()):
            problem = json.loads(line)
            code = (problem["prompt"] + problem["canonical_solution"]).rstrip() + "\n"
            edit = EDITS[i % len(EDITS)]
            yield {"task_id": problem["task_id"], "edit": edit,
                   "prompt": f"Here is a Python function:\n\n```python\n{code}```\n\n{edit}"}


def followup_questions(mt_bench: Path, n: int) -> list[dict]:
    """``n`` MT-Bench questions, taken round-robin over its categories (so any first few cover
    every category)."""
    by_category: dict[str, list[dict]] = {}
    with mt_bench.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                by_category.setdefault(q["category"], []).append(q)
    picked: list[dict] = []
    queues = list(by_category.values())
    while len(picked) < n and any(queues):
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--answer-model", required=True, help="Model spec that answers the first turns.")
@click.option("--questions", default=24, show_default=True, type=int, help="Follow-up records to build.")
@click.option("--max-new-tokens", default=256, show_default=True, type=int, help="Per first-turn answer.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=PACKAGED, show_default=True)
def main(answer_model: str, questions: int, max_new_tokens: int, out: Path) -> None:
    """Write the code_edit and mt_bench_followup sets under OUT."""
    from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
    from card.engine.loading.models import ModelConfig, load_model
    from card.engine.shared.config import GenerationRequest, StopParams

    path = out / CODE_EDIT
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in code_edit_records(PACKAGED / KNOWN["humaneval"]):
            f.write(json.dumps(record) + "\n")
    click.echo(f"wrote {path}", err=True)

    model = load_model(ModelConfig(answer_model))
    runner = InProcessRunner(model, None, RunnerConfig(mode=Mode.VANILLA))
    path = out / FOLLOWUP
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for q in followup_questions(PACKAGED / KNOWN["mt_bench"], questions):
            first = [{"role": "user", "content": q["turns"][0]}]
            ids = model.encode_prompt(first)
            result = runner.run(GenerationRequest(tuple(ids), stop=StopParams(max_new_tokens)))
            messages = [*first, {"role": "assistant", "content": result.text.strip()},
                        {"role": "user", "content": q["turns"][1]}]
            f.write(json.dumps({"question_id": q["question_id"], "category": q["category"],
                                "answer_model": model.name, "messages": messages}) + "\n")
            click.echo(f"  {q['question_id']} {q['category']}: {result.stats.new_tokens} tokens", err=True)
    click.echo(f"wrote {path}", err=True)


if __name__ == "__main__":
    main()
