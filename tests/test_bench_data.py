"""Benchmark prompts: the samples packaged with card-bench, and --data-dir /
$CARD_BENCH_DATA_DIR over them."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from card.client.bench import data
from card.client.bench.cli import main

PACKAGE_DIR = Path(data.__file__).resolve().parent


@pytest.fixture(autouse=True)
def no_data_dir(monkeypatch):
    monkeypatch.delenv(data.ENV_DATA_DIR, raising=False)


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _data_tree(root: Path) -> Path:
    _jsonl(root / "gsm8k" / "test.jsonl", [{"question": "Q1?", "answer": "1"}, {"question": "Q2?"}])
    _jsonl(root / "mt_bench" / "question.jsonl", [{"turns": [f"M{i}", "again"]} for i in range(4)])
    return root


def test_named_datasets_come_from_the_package_by_default():
    ds = data.load("gsm8k", 3)
    assert ds.path.is_relative_to(PACKAGE_DIR)
    assert ds.path == PACKAGE_DIR / "datasets" / "gsm8k" / "test.jsonl"
    assert len(ds.prompts) == 3 and ds.prompts[0].startswith("Janet")
    assert len(data.load("humaneval").prompts) == 164
    assert len(data.load("mt_bench").prompts) == 80
    for name in data.KNOWN:
        assert (PACKAGE_DIR / "datasets" / name / "LICENSE").is_file()


def test_the_packaged_gsm8k_sample_keeps_question_and_answer():
    lines = (PACKAGE_DIR / "datasets" / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 200
    assert all(set(json.loads(line)) == {"question", "answer"} for line in lines)
    with gzip.open(PACKAGE_DIR / "datasets" / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        assert json.loads(f.readline())["task_id"] == "HumanEval/0"


def test_a_data_dir_overrides_the_package(tmp_path, monkeypatch):
    root = _data_tree(tmp_path / "env")
    monkeypatch.setenv(data.ENV_DATA_DIR, str(root))
    ds = data.load("gsm8k", 2)
    assert ds.path == root / "gsm8k" / "test.jsonl" and ds.prompts == ("Q1?", "Q2?")
    # an explicit directory (card-bench --data-dir) wins over the environment
    other = _data_tree(tmp_path / "flag")
    _jsonl(other / "gsm8k" / "test.jsonl", [{"question": "F1?"}])
    assert data.load("gsm8k", 1, other).prompts == ("F1?",)
    # a data dir without the dataset is an error naming the file, not a silent fall-back to the sample
    with pytest.raises(data.NotFound, match=re.escape("humaneval/HumanEval.jsonl.gz")):
        data.load("humaneval", 1)


def test_name_path_and_plain_paths_still_work(tmp_path):
    path = _jsonl(tmp_path / "mine.jsonl", [{"prompt": "def f():"}, {"question": "Q?"}])
    assert data.load(f"code={path}", 5).name == "code"
    ds = data.load(str(path), 2)
    assert (ds.name, ds.path, ds.prompts) == ("mine", path, ("def f():", "Q?"))


def test_more_prompts_than_the_sample_has_warns_and_uses_the_sample(capsys):
    ds = data.load("gsm8k", 500)
    assert len(ds.prompts) == 200
    err = capsys.readouterr().err
    assert err == "gsm8k: the packaged sample has 200 prompts; --data-dir DIR for the full set\n"


def test_more_prompts_than_a_file_has_warns(tmp_path, capsys):
    root = _data_tree(tmp_path)
    assert len(data.load("mt_bench", 10, root).prompts) == 4
    assert "mt_bench:" in capsys.readouterr().err
    assert len(data.load("gsm8k", 2, root).prompts) == 2
    assert capsys.readouterr().err == ""


def test_card_bench_passes_data_dir_and_the_env_var(tmp_path, monkeypatch):
    """The datasets are read before any model loads: a data dir lacking one fails fast, naming it."""
    root = _data_tree(tmp_path)
    result = CliRunner().invoke(main, ["--data-dir", str(root), "--dataset", "humaneval", "--no-progress"])
    assert result.exit_code == 2, result.output
    assert str(root / "humaneval" / "HumanEval.jsonl.gz") in result.output
    monkeypatch.setenv(data.ENV_DATA_DIR, str(root))
    result = CliRunner().invoke(main, ["--dataset", "humaneval", "--no-progress"])
    assert result.exit_code == 2 and str(root) in result.output, result.output
    help_text = CliRunner().invoke(main, ["--help"]).output
    assert "--data-dir" in help_text and "CARD_BENCH_DATA_DIR" in help_text


def test_prompts_of_every_common_format() -> None:
    from card.client.bench.data import prompt_of
    from card.engine.shared.errors import InvalidArgument

    assert prompt_of("plain") == "plain"
    assert prompt_of({"text": "t"}) == "t"
    assert prompt_of({"instruction": "Summarise.", "input": "A long text."}) == "Summarise.\n\nA long text."
    assert prompt_of({"instruction": "Say hi.", "input": ""}) == "Say hi."
    assert prompt_of({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "h"},
                                        {"from": "gpt", "value": "g"}]}) == "h"
    with pytest.raises(InvalidArgument, match="conversations"):
        prompt_of({"unknown": 1})
    with pytest.raises(InvalidArgument, match="neither a string nor an object"):
        prompt_of(3)
