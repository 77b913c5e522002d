"""A GGUF converted once into a checkpoint folder: bitwise the direct load's model, and a cache with
a lock, a bound and a way out (card.engine.loading.gguf_cache)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from card.engine.loading import gguf_cache
from card.engine.loading.models import ModelConfig, load_model, load_tokenizer

F32 = torch.float32
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
# what a saved config gains or loses that no forward reads
CONFIG_BOOKKEEPING = {"architectures", "quantization_config", "_name_or_path", "transformers_version",
                      "dtype", "torch_dtype"}


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own; the GGUF itself stays where the suite fetched it."""
    monkeypatch.setenv("CARD_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.delenv(gguf_cache.CACHE_ENV, raising=False)
    return tmp_path / "models" / "converted"


def _config(model: torch.nn.Module) -> dict:
    return {k: v for k, v in model.config.to_dict().items() if k not in CONFIG_BOOKKEEPING}


def test_the_converted_default_model_is_the_direct_load_bit_for_bit(
        smollm2_gguf: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = str(smollm2_gguf)
    monkeypatch.setenv(gguf_cache.CACHE_ENV, "off")
    direct = load_model(ModelConfig(spec=spec, dtype="float32", prepack=False))
    assert not cache_root.exists()  # off means off: nothing written
    monkeypatch.delenv(gguf_cache.CACHE_ENV)

    first = load_model(ModelConfig(spec=spec, dtype="float32", prepack=False))  # converts
    (folder,) = [p for p in cache_root.iterdir() if not p.name.startswith(".")]
    assert (folder / "model.safetensors").is_file()
    assert gguf_cache.existing(smollm2_gguf, F32) == folder
    again = load_model(ModelConfig(spec=spec, dtype="float32", prepack=False))  # reads the folder
    bf16 = load_model(ModelConfig(spec=spec, dtype="bfloat16", prepack=False))  # a folder of its own
    folders = {p for p in cache_root.iterdir() if not p.name.startswith(".")}
    assert folders == {folder, gguf_cache.existing(smollm2_gguf, torch.bfloat16)}

    want = direct.model.state_dict()
    for loaded, dtype in ((first, torch.float32), (again, torch.float32), (bf16, torch.bfloat16)):
        got = loaded.model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k].to(dtype)) for k in want)  # every bit (bf16: the cast)
        assert [type(m) for m in loaded.model.modules()] == [type(m) for m in direct.model.modules()]
        assert _config(loaded.model) == _config(direct.model)
        assert loaded.fingerprint == direct.fingerprint
        assert loaded.eos_ids == direct.eos_ids and loaded.context_window == direct.context_window
        prompts = [m.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
                   for m in (loaded, direct)]
        assert prompts[0] == prompts[1]
    half_written = [p for p in cache_root.iterdir() if p.is_dir() and p.name.startswith(".")]
    assert not half_written

    text = "The quick brown fox jumps over the lazy dog."
    tok = load_tokenizer(spec)  # from the folder now: the same ids
    assert tok.encode(text) == direct.tokenizer.encode(text)


def _fake_gguf(folder: Path, name: str) -> Path:
    path = folder / f"{name}.gguf"
    path.write_bytes(name.encode())
    return path


def _writer(calls: list[Path]):
    def write(dest: Path) -> None:
        calls.append(dest)
        (dest / "config.json").write_text("{}")
    return write


def test_concurrent_first_loads_convert_once(tmp_path: Path, cache_root: Path) -> None:
    gguf = _fake_gguf(tmp_path, "m")
    calls: list[Path] = []
    results: dict[str, Path | None] = {}

    def ask() -> None:
        results["second"] = gguf_cache.convert_once(gguf, F32, _writer(calls))

    second = threading.Thread(target=ask)

    def first_write(dest: Path) -> None:
        second.start()  # it asks while this conversion holds the lock
        # with the lock working it cannot finish before this write does; without it, it would
        # write a second copy here
        second.join(timeout=2.0)
        _writer(calls)(dest)

    results["first"] = gguf_cache.convert_once(gguf, F32, first_write)
    second.join()
    assert len(calls) == 1
    assert results["first"] is not None and results["first"] == results["second"]
    assert (results["first"] / "config.json").is_file()


def test_a_failed_conversion_leaves_nothing_and_the_load_goes_direct(tmp_path: Path,
                                                                     cache_root: Path) -> None:
    gguf = _fake_gguf(tmp_path, "m")

    def full_disk(dest: Path) -> None:
        (dest / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    assert gguf_cache.convert_once(gguf, F32, full_disk) is None
    assert [p.name for p in cache_root.iterdir() if not p.name.endswith(".lock")] == []
    calls: list[Path] = []
    assert gguf_cache.convert_once(gguf, F32, _writer(calls)) is not None and len(calls) == 1


def test_a_changed_gguf_converts_again_and_the_least_recently_used_go(tmp_path: Path,
                                                                      cache_root: Path) -> None:
    calls: list[Path] = []
    ggufs = [_fake_gguf(tmp_path, f"m{i}") for i in range(gguf_cache.MAX_CONVERTED)]
    folders = [gguf_cache.convert_once(g, F32, _writer(calls)) for g in ggufs]
    assert len(calls) == gguf_cache.MAX_CONVERTED and all(f is not None and f.is_dir() for f in folders)
    # m0 is the oldest by conversion; using it makes m1 the least recently used
    for i, folder in enumerate(folders):
        assert folder is not None
        os.utime(folder / ".used", (1000 + i, 1000 + i))
    assert gguf_cache.existing(ggufs[0], F32) == folders[0]

    newer = _fake_gguf(tmp_path, "m1")  # rewritten: another size, another key
    newer.write_bytes(b"m1, another version")
    converted = gguf_cache.convert_once(newer, F32, _writer(calls))
    assert converted is not None and converted != folders[1]
    assert len(calls) == gguf_cache.MAX_CONVERTED + 1
    kept = {p for p in cache_root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert kept == {folders[0], folders[2], folders[3], converted}  # bounded; the used one stays
    assert gguf_cache.existing(ggufs[2], F32) == folders[2]


def test_off_reads_no_cache_and_writes_none(tmp_path: Path, cache_root: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = _fake_gguf(tmp_path, "m")
    calls: list[Path] = []
    assert gguf_cache.convert_once(gguf, F32, _writer(calls)) is not None
    monkeypatch.setenv(gguf_cache.CACHE_ENV, "off")
    assert gguf_cache.existing(gguf, F32) is None
    assert gguf_cache.convert_once(gguf, F32, _writer(calls)) is None
    assert len(calls) == 1


def test_no_room_on_the_disk_means_no_conversion(tmp_path: Path, cache_root: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = _fake_gguf(tmp_path, "m")
    free = 1 << 40
    real = shutil.disk_usage
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda where: real(where)._replace(free=free))
    calls: list[Path] = []
    free = gguf_cache._SPARE  # the folder would not fit beside the spare room
    assert gguf_cache.convert_once(gguf, F32, _writer(calls)) is None and not calls
    free = 1 << 40
    assert gguf_cache.convert_once(gguf, F32, _writer(calls)) is not None and len(calls) == 1


def test_a_read_only_cache_is_still_read(tmp_path: Path, cache_root: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = _fake_gguf(tmp_path, "m")
    folder = gguf_cache.convert_once(gguf, F32, _writer([]))
    assert folder is not None

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "touch", read_only)  # marking it used fails; reading it must not
    assert gguf_cache.existing(gguf, F32) == folder
