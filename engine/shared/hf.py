"""Names for the transformers objects the engine uses by duck typing.

A causal LM is reached through attributes that neither ``torch.nn.Module`` (its ``__getattr__``
answers ``Tensor | Module``) nor transformers' base classes declare: ``model.model.layers``,
``model.config.num_hidden_layers``, ``model.lm_head``. Every model the loader accepts has them
(``card.engine.shared.kv_pool.enable`` checks it once, with a clear error), so the type checker
is told so here, once, instead of at every use.
"""

from typing import Any, TypeAlias

CausalLM: TypeAlias = Any  # a transformers *ForCausalLM with model.embed_tokens/layers/norm/rotary_emb
Tokenizer: TypeAlias = Any  # a transformers PreTrainedTokenizerBase (encode, decode, chat template)
