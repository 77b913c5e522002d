"""Model loading, in one place.

A model spec is one of:
    - a Hugging Face id (``HuggingFaceTB/SmolLM2-135M-Instruct``), read from the local HF cache or
      the Hub;
    - a local folder holding a transformers checkpoint (config.json + weights), or a folder with
      exactly one ``.gguf`` file (tokenizer files beside it are used when present);
    - a path to a ``.gguf`` file (transformers dequantizes it; needs ``gguf`` and ``accelerate``);
      its first load keeps it converted as a checkpoint folder, which later loads read in seconds
      (card.engine.loading.gguf_cache; ``CARD_GGUF_CACHE=off`` turns that off);
    - ``default``: the embedded SmolLM2-135M-Instruct (card.engine.loading.embedded fetches it once).

Options: dtype (auto, float32, bfloat16, float16, float64), device (auto, cpu, cuda, cuda:N), and
quantize (``none`` or ``int8``: dynamic int8 Linear layers, CPU only), layers (keep only the
first N decoder layers: a self-speculative draft, engine.loading.draft_variants; 0 keeps all), prepack
(fp32 and bf16 on the CPU: Linear weights reordered once for oneDNN, card.engine.loading.cpu_linear; faster
multi-token forwards, on by default) and exact (row-wise layers made batch-invariant for the device,
card.engine.loading.invariant; off unless asked: a target asks, by default, and --exact off stops it;
a draft never needs it, its tokens only change the speed).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import io
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from card.engine.loading import gguf_cache
from card.engine.loading.devices import resolve_device
from card.engine.loading.fingerprint import tokenizer_fingerprint
from card.engine.loading.invariant import make_exact
from card.engine.loading.panel_gemm import KERNELS as CPU_LINEAR
from card.engine.shared.errors import InvalidArgument, NotFound
from card.engine.shared.hf import CausalLM, Tokenizer
from card.engine.shared.row_attention import SETTINGS as CPU_ATTENTION
from card.engine.shared.row_attention import record as record_cpu_attention

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
QUANTIZE = ("none", "int8")
DEFAULT_MODEL = "default"


@dataclass(frozen=True)
class ModelConfig:
    spec: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    quantize: str = "none"
    layers: int = 0
    prepack: bool = True
    # row-wise layers batch-invariant (card.engine.loading.invariant). Only a target's outputs
    # must not depend on the batch: its loaders ask for it (--exact); a draft only proposes, and
    # fixed tiles would make every draft forward pay for rows it does not have
    exact: bool = False
    # the packed CPU linears' kernel (card.engine.loading.panel_gemm.choose): auto, onednn or panel
    cpu_linear: str = "auto"
    # the exact attention of a CPU target (card.engine.shared.row_attention.use_kernel): auto,
    # torch or kernel
    cpu_attention: str = "auto"

    def __post_init__(self) -> None:
        if not self.spec:
            raise InvalidArgument("a model spec is empty")
        if self.cpu_attention not in CPU_ATTENTION:
            raise InvalidArgument(
                f"cpu_attention must be one of {', '.join(CPU_ATTENTION)}, got {self.cpu_attention!r}")
        if self.cpu_linear not in CPU_LINEAR:
            raise InvalidArgument(
                f"cpu_linear must be one of {', '.join(CPU_LINEAR)}, got {self.cpu_linear!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantize not in QUANTIZE:
            raise InvalidArgument(f"quantize must be one of {', '.join(QUANTIZE)}, got {self.quantize!r}")
        if self.layers < 0:
            raise InvalidArgument(f"layers must be >= 0 (0 keeps all), got {self.layers}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidArgument(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @property
    def label(self) -> str:
        options = [f"{self.layers} layers"] if self.layers else []
        if self.quantize != "none":
            options.append(self.quantize)
        return f"{self.spec} ({', '.join(options)})" if options else self.spec


@dataclass
class LoadedModel:
    """A causal LM ready for the engine, with everything the services need to know about it."""

    name: str
    model: CausalLM
    tokenizer: Tokenizer
    fingerprint: str
    eos_ids: frozenset[int]
    context_window: int
    exact: bool = True  # prepared for, and to be run by, the batch-invariant forward (ModelConfig.exact)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def encode_prompt(self, prompt: str | list[dict], chat: bool | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt; ``chat=None`` applies the chat template when there is one, with
        ``template_kwargs`` as its variables (Qwen3's ``enable_thinking``)."""
        use_chat = self.has_chat_template if chat is None else chat
        if use_chat and not self.has_chat_template:
            raise InvalidArgument(f"{self.name} has no chat template; use --no-chat")
        if isinstance(prompt, list):
            if not use_chat:
                raise InvalidArgument("a list of messages needs the chat template")
            messages = prompt
        else:
            if not prompt:
                raise InvalidArgument("the prompt is empty")
            messages = [{"role": "user", "content": prompt}]
        if use_chat:
            ids = self._apply_chat_template(messages, template_kwargs or {})
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def _apply_chat_template(self, messages: list[dict], template_kwargs: dict[str, Any]) -> Any:
        """The chat template over ``messages``; a template that refuses them (``raise_exception``,
        e.g. "Conversation roles must alternate") or fails on them is the request's error: one
        InvalidArgument with the template's own message, no traceback."""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      **template_kwargs)
        except TemplateError as err:
            raise InvalidArgument(f"the chat template of {self.name} refused the conversation: "
                                  f"{_one_line(err)}") from None
        except (TypeError, ValueError, KeyError, IndexError) as err:
            # raised while rendering: the template cannot handle these messages (their shape)
            raise InvalidArgument(f"the chat template of {self.name} failed on the conversation: "
                                  f"{type(err).__name__}: {_one_line(err)}") from None


def _one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most ``limit`` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _locate(spec: str) -> tuple[str, str | None]:
    """(path or HF id for from_pretrained, gguf file name or None)."""
    if spec == DEFAULT_MODEL:
        from card.engine.loading.embedded import ensure_default_model

        path = ensure_default_model()
        return str(path.parent), path.name
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise NotFound(f"model file {spec} does not exist")
        return str(path.parent), path.name
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file() and not ggufs:
            return str(path), None
        if len(ggufs) == 1:
            return str(path), ggufs[0].name
        if len(ggufs) > 1:
            raise InvalidArgument(f"{spec} holds several .gguf files; name one of them")
        raise NotFound(f"{spec} holds neither a transformers checkpoint nor a .gguf file")
    if spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1):
        raise NotFound(f"model path {spec} does not exist")
    return spec, None  # a Hugging Face id


def load_tokenizer(spec: str) -> Tokenizer:
    where, gguf = _locate(spec)
    if gguf:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):  # any conversion holds it
            if (converted := gguf_cache.existing(Path(where) / gguf, dtype)) is not None:
                return _tokenizer(str(converted), None)  # the same tokenizer, without the GGUF's parse
    return _tokenizer(where, gguf)


def _tokenizer(where: str, gguf: str | None) -> object:
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json")
    has_tokenizer_files = any((Path(where) / name).is_file() for name in names)
    if gguf and not has_tokenizer_files:
        tok = AutoTokenizer.from_pretrained(where, gguf_file=gguf)
        if not getattr(tok, "chat_template", None):
            from card.engine.loading.embedded import gguf_chat_template

            tok.chat_template = gguf_chat_template(Path(where) / gguf)
        return tok
    return AutoTokenizer.from_pretrained(where)


def _cache_gguf_name_maps() -> None:
    """transformers builds gguf-py's tensor-name map once per *module* of the model while it maps
    GGUF tensors to parameters (397 times for SmolLM2-135M, 5.6 of a 16 s load on this project's
    CPU VM); the map depends only on (architecture, blocks) and is only read, so one per pair does.
    transformers imports the function from the package at each call, so the package's name is the
    one to replace."""
    import gguf

    if not hasattr(gguf.get_tensor_name_map, "cache_info"):
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=16)(gguf.get_tensor_name_map)


@contextlib.contextmanager
def _one_gguf_reader_per_file() -> Iterator[None]:
    """transformers parses a GGUF file's whole metadata (the tokenizer's vocabulary and merges
    included) twice per load, once for the config and once for the weights: 4 s each for
    SmolLM2-135M. Within one load, the second parse of the same file returns the first reader (it
    is only read); the readers go when the load ends."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader(path: str | os.PathLike, mode: Literal["r", "r+", "c"] = "r") -> object:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[misc,assignment]  # for this load only, restored below
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
        readers.clear()


def _from_pretrained(spec: str, where: str, gguf: str | None,
                     dtype: torch.dtype) -> tuple[CausalLM, Tokenizer]:
    """transformers' own load of a folder, a Hugging Face id or a GGUF file; errors name the spec."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"dtype": dtype}
    if gguf:
        kwargs["gguf_file"] = gguf
        _cache_gguf_name_maps()
    try:
        # transformers prints progress bars while dequantizing GGUF tensors; keep logs clean
        with _one_gguf_reader_per_file():  # the tokenizer may come from the same file
            with contextlib.redirect_stderr(io.StringIO()):
                model: CausalLM = AutoModelForCausalLM.from_pretrained(where, **kwargs)
            tokenizer = _tokenizer(where, gguf)
    except OSError as exc:
        raise NotFound(
            f"cannot load model {spec!r}: {str(exc).splitlines()[0]} "
            "(give a local folder, a .gguf file, a Hugging Face id in the local cache, or 'default')"
        ) from exc
    return model, tokenizer


def _save_checkpoint(model: CausalLM, tokenizer: Tokenizer, dest: Path) -> None:
    """``model`` (plain modules: packed or tiled layers cannot be saved) and its tokenizer as a
    transformers checkpoint folder."""
    # a dequantized GGUF model still carries its quantizer, which refuses to serialize
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with contextlib.redirect_stderr(io.StringIO()):  # a progress bar per shard
        model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _converted(spec: str, where: str, gguf: str, dtype: torch.dtype) -> Path | None:
    """The GGUF as a checkpoint folder in ``dtype``, converted on its first load in that dtype
    (card.engine.loading.gguf_cache): the direct load's weights, saved as they are."""
    def write(dest: Path) -> None:
        model, tokenizer = _from_pretrained(spec, where, gguf, dtype)
        _save_checkpoint(model, tokenizer, dest)

    return gguf_cache.convert_once(Path(where) / gguf, dtype, write)


def load_model(config: ModelConfig) -> LoadedModel:
    """Load a model and its tokenizer; errors name the spec and say what to do."""
    where, gguf = _locate(config.spec)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if gguf and (converted := _converted(config.spec, where, gguf, dtype)) is not None:
        where, gguf = str(converted), None
    model, tokenizer = _from_pretrained(config.spec, where, gguf, dtype)
    model = model.to(device).eval()
    if config.layers:
        from card.engine.loading.draft_variants import truncate_layers

        model = truncate_layers(model, config.layers)
    if config.quantize == "int8":
        if device.type != "cpu":
            raise InvalidArgument("quantize=int8 runs on the CPU only")
        with warnings.catch_warnings():  # torch.ao.quantization warns it is moving to torchao
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    else:
        make_exact(model, exact=config.exact, prepack=config.prepack, cpu_linear=config.cpu_linear)
    record_cpu_attention(model, config.cpu_attention)  # its KV pools' exact attention
    if device.type == "cpu":
        own_memory(model)
    return LoadedModel(
        name=config.label,
        model=model,
        tokenizer=tokenizer,
        fingerprint=tokenizer_fingerprint(tokenizer),
        eos_ids=eos_ids_of(model, tokenizer),
        context_window=context_window_of(model.config),
        exact=config.exact,
    )


def context_window_of(config: Any) -> int:
    """Tokens one sequence may hold: the model's positions, and no more than its attention window
    where one applies (Mistral-7B-v0.1: 4,096 of 32,768). Up to the window a sliding window sees
    every earlier token, which is what the engine's attention computes; past it the model would
    see fewer, and the engine would decode other tokens (Qwen2's per-layer windows are refused at
    load instead, card.engine.shared.kv_pool.enable)."""
    window = int(getattr(config, "max_position_embeddings", 0) or 2048)
    sliding = getattr(config, "sliding_window", None)
    if sliding and getattr(config, "use_sliding_window", True):  # Mistral has no switch: set = on
        window = min(window, int(sliding))
    return window


def own_memory(model: CausalLM) -> None:
    """Give every parameter and buffer memory of its own, one tensor at a time.

    A safetensors checkpoint is memory-mapped, and a tensor that is still a view of the file (the
    embeddings, the norms, an LM head beside its packed copy) keeps the whole mapping alive, so
    every page read while loading and packing stays resident: a Qwen2.5-1.5B target held 13.7 GiB
    for 6.6 GiB of weights, 7.1 GiB after this. Then the C heap gives back what loading freed (an
    int8 draft's quantization leaves ~1.5 GiB of freed fp32 copies in glibc's arenas: 2.98 GiB
    resident for 1 GiB of weights, 1.47 GiB after the trim)."""
    with torch.no_grad():
        for module in model.modules():
            for p in module.parameters(recurse=False):
                p.data = p.data.clone()
            for name, b in list(module.named_buffers(recurse=False)):
                module._buffers[name] = b.clone()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def export_checkpoint(spec: str, dest: Path, dtype: str = "float32") -> LoadedModel:
    """Save a model spec (typically a .gguf file) as a transformers checkpoint folder.

    GGUF files are dequantized on every load (minutes for a 1.5B model); the exported folder holds
    the same dequantized weights as safetensors plus the tokenizer (chat template included) and
    loads in seconds, with the same tokenizer fingerprint (what a GGUF load keeps converted on
    its own in each dtype, card.engine.loading.gguf_cache, is this folder).
    """
    if dest.exists() and any(dest.iterdir()):
        raise InvalidArgument(f"{dest} exists and is not empty")
    # plain modules: packed or tiled layers cannot be saved
    loaded = load_model(ModelConfig(spec=spec, dtype=dtype, device="cpu", prepack=False, exact=False))
    _save_checkpoint(loaded.model, loaded.tokenizer, dest)
    return loaded


def eos_ids_of(model: CausalLM, tokenizer: Tokenizer) -> frozenset[int]:
    """Every EOS id the model declares (generation config and tokenizer)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)
