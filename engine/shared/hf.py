"""Names for the transformers objects the engine uses by duck typing.

A causal LM is reached through attributes that neither ``torch.nn.Module`` (its ``__getattr__``
answers ``Tensor | Module``) nor transformers' base classes declare: ``model.model.layers``,
``model.config.num_hidden_layers``, ``model.lm_head``. Every model the loader accepts has them
(``card.engine.shared.kv_pool.enable`` checks it once, with a clear error), so the type checker
is told so here, once, instead of at every use.
"""

import inspect
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import torch

CausalLM: TypeAlias = Any  # a transformers *ForCausalLM with model.embed_tokens/layers/norm/rotary_emb
Tokenizer: TypeAlias = Any  # a transformers PreTrainedTokenizerBase (encode, decode, chat template)


def cache_keyword(layer_class: "type[torch.nn.Module]") -> str:
    """The keyword a decoder layer's ``forward`` takes its KV cache by, in the installed transformers:
    ``cache`` where it declares one (5.2x renamed ``past_key_values``, deprecated there and gone
    in 5.40, after which the old name would vanish into the layer's ``**kwargs``: it would attend
    without writing a key), else ``past_key_values`` (earlier 5.x)."""
    forward = layer_class.forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def __getattr__(name: str) -> str:
    """``CACHE_KEYWORD``: the keyword for every family the engine runs (kv_pool.MODEL_TYPES rename
    with transformers' release; kv_pool.enable checks a model's layers agree). A module constant,
    so that a compiled step (card.engine.shared.static_step) reads a string rather than tracing
    ``inspect``; computed on first use, so that importing this module does not import transformers
    (card-client, the cache service)."""
    if name != "CACHE_KEYWORD":
        raise AttributeError(name)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    keyword = cache_keyword(LlamaDecoderLayer)
    globals()["CACHE_KEYWORD"] = keyword
    return keyword
