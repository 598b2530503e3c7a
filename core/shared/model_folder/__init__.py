"""Reading a model folder into a `ModelSpec` (core/shared/config.py), as plain JSON, without torch or
transformers, so the frontend refuses a bad model in the caller's process before any child starts.

Both sentence-transformers (ST) config generations are read -- the older `pooling_mode_*` flags with
`max_seq_length` in sentence_bert_config.json, and what ST 5/6 write (`pooling_mode`,
`include_prompt`, `model_max_length` in tokenizer_config.json) -- and every module in modules.json
becomes something the engine runs. A module, pooling mode or config key that would change the output
and is not implemented is a ValueError naming it: never a silently different vector.

One module per thing read; imports run one way, from the entry point down:

- `load.py`: `load_model_spec`, the entry point: a Router model (`router.py`) or one chain of modules;
- `router.py`: ST's Router (Asym): a spec per route, each route a chain;
- `chain_spec.py`: one chain's `ModelSpec`, from its `STLayout` and the transformer's config.json;
- `st_modules.py`: modules.json, the chain of modules in order;
- `st_config.py`: config_sentence_transformers.json;
- `transformer_module.py`: the Transformer module's sentence_bert_config.json;
- `transformer_config.py`: the transformer's own config.json and the lengths it allows;
- `multi_vector.py`: a multi-vector (ColBERT) model's settings and modules;
- `static_embedding.py`: a StaticEmbedding (model2vec) folder;
- `st_layout.py`: `STLayout`, what the ST files say, filled in as they are read;
- `st_files.py`: JSON, modules.json's entries, and the Dense module config several layouts share;
- `model_path.py`: where the model folder is (a path, a cache folder, a hub id, the bundled default).
"""
