"""How models get here: loading (HF ids, folders, GGUF), the embedded default model, tokenizer
fingerprints, CPU kernels, draft variants and the device resolver. The algorithm (the tree, the
drafter, the target loop, the chain sources) is in ``engine`` itself and never loads anything."""
