"""The GGUF load shortcuts of engine.loading.models: one metadata parse per file per load, and
gguf-py's tensor-name maps built once per (architecture, blocks). Both leave gguf-py as it was."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from card.engine.loading.models import _cache_gguf_name_maps, _one_gguf_reader_per_file


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_reader_per_file_within_a_load_and_none_kept_after(gguf_file):
    original = gguf.GGUFReader
    with _one_gguf_reader_per_file():
        first, second = gguf.GGUFReader(gguf_file), gguf.GGUFReader(str(gguf_file))
        assert first is second and isinstance(first, original)
        assert [t.name for t in first.tensors] == ["token_embd.weight"]
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(gguf_file) is not first  # control: without the shortcut, a new parse


def test_the_reader_is_restored_when_the_load_fails(gguf_file):
    original = gguf.GGUFReader
    with pytest.raises(RuntimeError), _one_gguf_reader_per_file():
        raise RuntimeError("the load failed")
    assert gguf.GGUFReader is original


def test_name_maps_are_built_once_per_architecture_and_depth():
    _cache_gguf_name_maps()
    _cache_gguf_name_maps()  # idempotent: never wrapped twice
    arch = gguf.MODEL_ARCH.LLAMA
    assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.get_tensor_name_map(arch, 3) is not gguf.get_tensor_name_map(arch, 2)
    assert gguf.get_tensor_name_map(arch, 2).get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
