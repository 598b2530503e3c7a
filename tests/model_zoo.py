"""A zoo of tiny models of the families people use, saved the way sentence-transformers (ST) saves them.

Each builder takes a directory (a pytest `tmp_path`), writes one model into a new folder inside it and
returns that folder's path. Weights are random (fixed seed), the models tiny (hidden 32, 2 layers), so
each builds in about a second. The reference is ST itself: the layouts are written by ST's own classes
(`SentenceTransformer(modules=[...]).save`, `CrossEncoder(...).save`, `SparseEncoder(modules=[...]).save`),
and the older layouts (`sentence_transformers.models.*` types, `pooling_mode_*` flags, `max_seq_length` in
`sentence_bert_config.json`) are written by hand, as ST 2.x-4.x wrote them; ST 6 still loads both.

Tokenizers: the bundled WordPiece one (all-MiniLM's), and byte-level BPE and Unigram tokenizers trained
here on the standard library's docstrings, wrapped as `PreTrainedTokenizerFast` with the normalizer,
pre-tokenizer, post-processor and padding side of the real model they stand for.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

SEED = 0
MAX_LEN = 128  # every zoo model truncates here, so the tests' long texts are cut
LLM_RERANKER_MAX_LEN = 256
HIDDEN = 32
WORDPIECE_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Initialised with a wider spread than transformers' 0.02 so the outputs depend strongly on the input:
# a truncation or pooling mistake then moves the vectors far beyond the tests' tolerance.
INIT_RANGE = 0.2
SPLADE_LOGIT_BIAS = -3.5

# Qwen2 / Qwen3's pre-tokenizer regex (GPT-4 style, one digit per piece).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
QWEN_PROMPTS = {"query": QWEN_QUERY_PROMPT, "document": ""}
E5_PROMPTS = {"query": "query: ", "passage": "passage: "}

ST_TYPES_OLD = {
    "Transformer": "sentence_transformers.models.Transformer",
    "Pooling": "sentence_transformers.models.Pooling",
    "Dense": "sentence_transformers.models.Dense",
    "Normalize": "sentence_transformers.models.Normalize",
    "LayerNorm": "sentence_transformers.models.LayerNorm",
    "MLMTransformer": "sentence_transformers.sparse_encoder.models.MLMTransformer",
    "SpladePooling": "sentence_transformers.sparse_encoder.models.SpladePooling",
}
# The fixed order in which ST concatenates the old `pooling_mode_*` flags (not the order of the keys).
OLD_POOLING_FLAGS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


def _seed() -> None:
    import torch

    torch.manual_seed(SEED)


def _fresh(target: str | Path, name: str) -> Path:
    path = Path(target) / name
    if path.exists():
        shutil.rmtree(path)
    return path


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _training_texts() -> tuple[str, ...]:
    import corpus

    return corpus.docstrings()[::4]


@functools.cache
def _bpe_json(kind: str) -> str:
    """A byte-level BPE trained on docstrings. kind "qwen": NFC + the Qwen2 Split regex + ByteLevel
    (no regex), as Qwen2/Qwen3's tokenizer.json; "roberta" and "gpt2": ByteLevel with the GPT-2 regex
    (their special tokens differ)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if kind == "qwen":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    elif kind == "gpt2":
        specials = ["<|endoftext|>"]
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_texts(), trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=1)
def _unigram_pieces() -> tuple[tuple[str, float], ...]:
    """A SentencePiece-style Unigram vocabulary (pieces and scores, no special tokens) trained once."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=2000, special_tokens=["<unk>"], unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(_training_texts(), trainer)
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    return tuple((piece, score) for piece, score in vocab if piece != "<unk>")


def _unigram(specials: list[str], unk: str, mask: str | None):
    """A Unigram tokenizer with `specials` at ids 0.. (as SentencePiece models list them) and `mask`
    (if any) as the last id, as XLM-R / DeBERTa-v3 do."""
    from tokenizers import Tokenizer, models

    pieces = [(s, 0.0) for s in specials] + list(_unigram_pieces()) + ([(mask, 0.0)] if mask else [])
    tok = Tokenizer(models.Unigram(pieces, unk_id=specials.index(unk), byte_fallback=False))
    tok.add_special_tokens(specials + ([mask] if mask else []))
    return tok


def _fast(tok, **kwargs):
    from transformers import PreTrainedTokenizerFast

    kwargs.setdefault("model_max_length", MAX_LEN)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def qwen_tokenizer():
    """Qwen3-Embedding's shape: byte-level BPE, `<|endoftext|>` appended by a TemplateProcessing
    post-processor, pad = `<|endoftext|>`, eos = `<|im_end|>`, padding on the left."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(_bpe_json("qwen"))
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A:0 <|endoftext|>:0", pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eot)])
    return _fast(tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left",
                 additional_special_tokens=["<|im_start|>"])


def gpt2_tokenizer():
    """GPT-2's shape (SGPT and other GPT-2 / GPT-Neo / GPT-J embedders): byte-level BPE with the
    GPT-2 regex, no special tokens added around a text, `<|endoftext|>` as bos / eos / unk and as
    the pad token (GPT-2 has none: ST users set it so), and the GPT2Tokenizer class, whose
    model_input_names carry no token_type_ids."""
    from tokenizers import Tokenizer
    from transformers import GPT2Tokenizer

    model = json.loads(_bpe_json("gpt2"))["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = GPT2Tokenizer(vocab=model["vocab"], merges=merges, pad_token="<|endoftext|>", model_max_length=MAX_LEN)
    assert isinstance(tok.backend_tokenizer, Tokenizer) and "token_type_ids" not in tok.model_input_names
    return tok


def roberta_tokenizer():
    """RoBERTa's shape: byte-level BPE (GPT-2 regex), `<s> A </s>` / `<s> A </s></s> B </s>`, pad id 1."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(_bpe_json("roberta"))
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True, add_prefix_space=False)
    return _fast(tok, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                 pad_token="<pad>", mask_token="<mask>")


def xlmr_tokenizer():
    """XLM-R's shape: SentencePiece Unigram, NFKC-like normalizer + collapsed spaces, Metaspace,
    `<s> A </s>` / `<s> A </s> </s> B </s>`, `<s>`=0 `<pad>`=1 `</s>`=2 `<unk>`=3, `<mask>` last."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    tok = _unigram(["<s>", "<pad>", "</s>", "<unk>"], "<unk>", "<mask>")
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return _fast(tok, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                 pad_token="<pad>", mask_token="<mask>")


def t5_tokenizer():
    """T5's shape: SentencePiece Unigram, WhitespaceSplit + Metaspace, `</s>` appended,
    `<pad>`=0 `</s>`=1 `<unk>`=2, no BOS, no token types."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    tok = _unigram(["<pad>", "</s>", "<unk>"], "<unk>", None)
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    return _fast(tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def deberta_tokenizer():
    """DeBERTa-v2/v3's shape: SentencePiece Unigram with Metaspace only (a character-local normalizer),
    `[CLS] A [SEP]` / `[CLS] A [SEP] B [SEP]` with token types, `[PAD]`=0 `[CLS]`=1 `[SEP]`=2 `[UNK]`=3."""
    from tokenizers import decoders, normalizers, pre_tokenizers, processors

    tok = _unigram(["[PAD]", "[CLS]", "[SEP]", "[UNK]"], "[UNK]", "[MASK]")
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    return _fast(tok, bos_token="[CLS]", eos_token="[SEP]", cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]",
                 pad_token="[PAD]", mask_token="[MASK]")


def mpnet_tokenizer():
    """MPNet's shape: the BERT WordPiece vocabulary with MPNet's specials (`<s>`=0 `<pad>`=1 `</s>`=2
    `<unk>`=3, `<mask>` last), `<s> A </s>` / `<s> A </s> </s> B </s>`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    words = [w for w in _bundled_vocab() if w not in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")]
    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", *words, "<mask>"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return _fast(tok, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                 pad_token="<pad>", mask_token="<mask>")


def wordpiece_tokenizer():
    """The bundled all-MiniLM WordPiece tokenizer (BERT's), with model_max_length MAX_LEN."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_bundled_dir(), model_max_length=MAX_LEN)


# An added token with a spacing diacritic: NFKD turns U+00A8 into a space and a combining mark, which
# strip_accents drops, so the token's normalized form is "a b" and the library matches it in the
# normalized text, where clean_text made tabs, newlines and carriage returns spaces ("a\tb" is one token).
SPACED_ADDED_TOKEN = "a\u00a8b"


def spaced_added_token_tokenizer():
    """BERT's WordPiece vocabulary behind NFKD + BertNormalizer (clean_text, lowercase) with the
    normalized added token SPACED_ADDED_TOKEN, as a PreTrainedTokenizerFast (transformers' BertTokenizer
    would rebuild the normalizer from its own arguments and drop the NFKD)."""
    from tokenizers import AddedToken, Tokenizer, normalizers

    tok = Tokenizer.from_str(wordpiece_tokenizer().backend_tokenizer.to_str())
    tok.no_padding()
    tok.no_truncation()
    tok.normalizer = normalizers.Sequence([normalizers.NFKD(), normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True)])
    tok.add_tokens([AddedToken(SPACED_ADDED_TOKEN, normalized=True)])
    return _fast(tok, cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]", pad_token="[PAD]",
                 mask_token="[MASK]")


# The tokenizers the long-input tests run on, by the family they stand for.
TOKENIZERS: dict[str, Callable] = {
    "qwen-bpe": qwen_tokenizer, "roberta-bpe": roberta_tokenizer, "xlmr-unigram": xlmr_tokenizer,
    "t5-unigram": t5_tokenizer, "deberta-unigram": deberta_tokenizer, "mpnet-wordpiece": mpnet_tokenizer,
    "bert-wordpiece": wordpiece_tokenizer,
}


def _bundled_dir() -> Path:
    from pooling_pipeline.core.shared.model_folder.model_path import default_model_path

    return Path(default_model_path())


@functools.lru_cache(maxsize=1)
def _bundled_vocab() -> tuple[str, ...]:
    return tuple((_bundled_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines())


def copy_wordpiece(target: Path, model_max_length: int | None = MAX_LEN) -> None:
    """Copies the bundled WordPiece tokenizer files into `target` (model_max_length rewritten, or
    removed when None)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in WORDPIECE_FILES:
        shutil.copy(_bundled_dir() / name, target / name)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("model_max_length", None)
    if model_max_length is not None:
        cfg["model_max_length"] = model_max_length
    cfg_path.write_text(json.dumps(cfg, indent=2))


# --------------------------------------------------------------------------------------------------
# Backbones (transformers' own classes), saved as plain HF dirs
# --------------------------------------------------------------------------------------------------

def _bert_config(**kwargs):
    from transformers import BertConfig

    base = dict(vocab_size=30522, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=512, initializer_range=INIT_RANGE)
    return BertConfig(**{**base, **kwargs})


def _save_hf(model, tokenizer, path: Path) -> Path:
    model.eval().save_pretrained(path)
    if tokenizer is None:
        copy_wordpiece(path)
    else:
        tokenizer.save_pretrained(path)
    return path


def hf_bert(target: str | Path, name: str = "hf-bert", head: str | None = None, num_labels: int = 1,
            model_max_length: int | None = MAX_LEN) -> str:
    """A plain HF BERT dir with the bundled WordPiece tokenizer. head: None (BertModel),
    "seq-cls" (BertForSequenceClassification, num_labels) or "mlm" (BertForMaskedLM)."""
    from transformers import BertForMaskedLM, BertForSequenceClassification, BertModel

    path = _fresh(target, name)
    _seed()
    if head == "seq-cls":
        model = BertForSequenceClassification(_bert_config(num_labels=num_labels))
    elif head == "mlm":
        import torch

        model = BertForMaskedLM(_bert_config())
        # A negative output bias makes the SPLADE vectors sparse, as a trained model's are (a few
        # dozen to a few thousand active terms instead of most of the vocabulary).
        with torch.no_grad():
            model.cls.predictions.bias.fill_(SPLADE_LOGIT_BIAS)
    else:
        model = BertModel(_bert_config(), add_pooling_layer=False)
    model.eval().save_pretrained(path)
    copy_wordpiece(path, model_max_length)
    return str(path)


def hf_backbone(target: str | Path, family: str, name: str | None = None) -> str:
    """A plain HF dir of one encoder or decoder family with a tokenizer of its shape."""
    import transformers as tf

    path = _fresh(target, name or f"hf-{family}")
    _seed()
    common = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, initializer_range=INIT_RANGE)
    if family == "bert":
        return hf_bert(target, name=path.name)
    if family == "distilbert":
        model = tf.DistilBertModel(tf.DistilBertConfig(vocab_size=30522, dim=HIDDEN, n_layers=2, n_heads=4,
                                                       hidden_dim=64, max_position_embeddings=512,
                                                       initializer_range=INIT_RANGE))
        return str(_save_hf(model, None, path))
    if family == "modernbert":
        # local_attention 16: sequences beyond 16 tokens go through the sliding-window layers.
        cfg = tf.ModernBertConfig(vocab_size=30522, hidden_size=HIDDEN, max_position_embeddings=512,
                                  global_attn_every_n_layers=2, local_attention=16, pad_token_id=0, bos_token_id=101,
                                  eos_token_id=102, cls_token_id=101, sep_token_id=102, **common)
        return str(_save_hf(tf.ModernBertModel(cfg), None, path))
    if family == "mpnet":
        tok = mpnet_tokenizer()
        cfg = tf.MPNetConfig(vocab_size=len(tok), hidden_size=HIDDEN, max_position_embeddings=MAX_LEN + 2,
                             pad_token_id=1, bos_token_id=0, eos_token_id=2, **common)
        return str(_save_hf(tf.MPNetModel(cfg, add_pooling_layer=False), tok, path))
    if family in ("xlmr", "roberta"):
        tok = xlmr_tokenizer() if family == "xlmr" else roberta_tokenizer()
        cfg_cls, model_cls = ((tf.XLMRobertaConfig, tf.XLMRobertaModel) if family == "xlmr"
                              else (tf.RobertaConfig, tf.RobertaModel))
        cfg = cfg_cls(vocab_size=len(tok), hidden_size=HIDDEN, max_position_embeddings=MAX_LEN + 2, type_vocab_size=1,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2, **common)
        return str(_save_hf(model_cls(cfg, add_pooling_layer=False), tok, path))
    if family == "deberta-v2":
        tok = deberta_tokenizer()
        cfg = tf.DebertaV2Config(vocab_size=len(tok), hidden_size=HIDDEN, max_position_embeddings=512, type_vocab_size=0,
                                 relative_attention=True, position_buckets=32, max_relative_positions=-1,
                                 pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm",
                                 share_att_key=True, pad_token_id=0, **common)
        return str(_save_hf(tf.DebertaV2Model(cfg), tok, path))
    if family in ("t5", "mt5", "umt5"):
        tok = t5_tokenizer()
        # Saved whole (encoder and decoder), as sentence-t5 / GTR checkpoints derive from t5 ones; ST loads
        # only T5EncoderModel from it.
        cfg = tf.T5Config(vocab_size=len(tok), d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1,
                          num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                          feed_forward_proj="relu", initializer_factor=1.0, pad_token_id=0, eos_token_id=1,
                          decoder_start_token_id=0)
        if family != "t5":  # mT5 / UMT5 (UMT5: a relative bias in every layer): the same config keys
            cfg_cls, model_cls = (tf.MT5Config, tf.MT5Model) if family == "mt5" else (tf.UMT5Config, tf.UMT5Model)
            cfg = cfg_cls(**{k: v for k, v in cfg.to_dict().items() if k in cfg_cls().to_dict()})
            return str(_save_hf(model_cls(cfg), tok, path))
        return str(_save_hf(tf.T5Model(cfg), tok, path))
    if family in ("gpt2", "gpt_neo", "gptj"):
        # GPT-2 names its sizes n_embd / n_positions (GPT-J too): read through the config's attribute_map.
        # GPT-Neo adds wte(token_type_ids) to every position when they are given, so sending zeros
        # where the tokenizer makes none changes every vector. GPT-J: rotary positions.
        tok = gpt2_tokenizer()
        eot = tok.convert_tokens_to_ids("<|endoftext|>")
        ids = dict(vocab_size=len(tok), bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, initializer_range=INIT_RANGE)
        if family == "gpt2":
            model = tf.GPT2Model(tf.GPT2Config(n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=MAX_LEN, **ids))
        elif family == "gpt_neo":
            model = tf.GPTNeoModel(tf.GPTNeoConfig(hidden_size=HIDDEN, num_layers=2, num_heads=4,
                                                   attention_types=[[["global", "local"], 1]], window_size=16,
                                                   max_position_embeddings=MAX_LEN, **ids))
        else:
            model = tf.GPTJModel(tf.GPTJConfig(n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=4, n_positions=MAX_LEN,
                                               **ids))
        return str(_save_hf(model, tok, path))
    if family in ("qwen3", "qwen2", "llama", "mistral"):
        tok = qwen_tokenizer()
        eot = tok.convert_tokens_to_ids("<|endoftext|>")
        kw = dict(vocab_size=len(tok), hidden_size=HIDDEN, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=eot, eos_token_id=eot, bos_token_id=None, tie_word_embeddings=False, **common)
        cfg_cls, model_cls = {"qwen3": (tf.Qwen3Config, tf.Qwen3Model), "qwen2": (tf.Qwen2Config, tf.Qwen2Model),
                              "llama": (tf.LlamaConfig, tf.LlamaModel), "mistral": (tf.MistralConfig, tf.MistralModel)}[family]
        if family == "qwen3":
            kw["head_dim"] = 8
        if family == "mistral":
            kw["sliding_window"] = None
        return str(_save_hf(model_cls(cfg_cls(**kw)), tok, path))
    return _attention_variant_backbone(tf, family, path, common)


def _attention_variant_backbone(tf, family: str, path: Path, common: dict) -> str:
    """hf_backbone's families whose attention ST's batching changes (tests/test_architectures.py):
    BigBird's block-sparse attention, Funnel's pooled attention, XLNet's relative positions."""
    if family == "big_bird":
        # Block-sparse attention with blocks of 4 and one random block: transformers runs it for a
        # batch longer than (5 + 2 * 1) * 4 = 28 tokens and switches to full attention at or below.
        cfg = tf.BigBirdConfig(vocab_size=30522, hidden_size=HIDDEN, max_position_embeddings=512,
                               attention_type="block_sparse", block_size=4, num_random_blocks=1, **common)
        return str(_save_hf(tf.BigBirdModel(cfg, add_pooling_layer=False), None, path))
    if family == "funnel":
        # Funnel's own tokenizer (<cls> and <sep> added to the WordPiece vocabulary); a FunnelModel
        # (with its decoder: one state per input token), pooling once between two blocks of one layer
        # (with three blocks, transformers' Funnel fails on a 3-token text: ST too).
        vocab = {w: i for i, w in enumerate(_bundled_vocab())}
        tok = tf.FunnelTokenizer(vocab=vocab, model_max_length=MAX_LEN)
        cfg = tf.FunnelConfig(vocab_size=len(tok), block_sizes=[1, 1], num_decoder_layers=1, d_model=HIDDEN, n_head=4,
                              d_head=8, d_inner=64, initializer_range=INIT_RANGE)
        return str(_save_hf(tf.FunnelModel(cfg), tok, path))
    if family == "xlnet":
        # XLNet's own tokenizer class on the zoo's Unigram pieces: `A <sep> <cls>`, padding on the
        # left, and no model_max_length (XLNet has relative positions and no position table).
        specials = ["<unk>", "<s>", "</s>", "<cls>", "<sep>", "<pad>", "<mask>", "<eod>", "<eop>"]
        tok = tf.XLNetTokenizer(vocab=[(s, 0.0) for s in specials] + list(_unigram_pieces()))
        cfg = tf.XLNetConfig(vocab_size=len(tok), d_model=HIDDEN, n_layer=2, n_head=4, d_inner=64,
                             pad_token_id=tok.pad_token_id, initializer_range=INIT_RANGE)
        return str(_save_hf(tf.XLNetModel(cfg), tok, path))
    raise ValueError(f"unknown family {family!r}")


# --------------------------------------------------------------------------------------------------
# sentence-transformers layouts, written by ST 6 itself
# --------------------------------------------------------------------------------------------------

def _save_st(target: Path, name: str, hf_dir: str, modules: list, *, model_cls=None, transformer_task=None,
             **model_kwargs) -> str:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer

    path = _fresh(target, name)
    kwargs = {"transformer_task": transformer_task} if transformer_task else {}
    first = Transformer(hf_dir, **kwargs)
    model = (model_cls or SentenceTransformer)(modules=[first, *modules], device="cpu", **model_kwargs)
    model.save(str(path))
    shutil.rmtree(hf_dir)
    return str(path)


def build_st(target: str | Path, family: str = "bert", *, name: str | None = None,
             pooling_mode: str | tuple[str, ...] = "mean", include_prompt: bool = True,
             dense: dict | None = None, layer_norm: bool = False, normalize: bool = False,
             prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
             truncate_dim: int | None = None, tokenizer_extra: dict | None = None) -> str:
    """A SentenceTransformer in ST 6's own layout: Transformer (a `family` backbone), Pooling
    (`pooling_mode`, a mode or a tuple, `include_prompt`), optional Dense (`dense` = kwargs of
    `Dense`, e.g. {"out_features": 16, "bias": True, "activation": "tanh"}), LayerNorm, Normalize;
    prompts / default_prompt_name / truncate_dim in config_sentence_transformers.json;
    `tokenizer_extra` keys merged into tokenizer_config.json before ST loads it (e.g. a chat_template).
    Max length: model_max_length 128 in tokenizer_config.json."""
    import torch
    from sentence_transformers.base.modules import Dense, Normalize
    from sentence_transformers.sentence_transformer.modules import LayerNorm, Pooling

    target = Path(target)
    mode_tag = pooling_mode if isinstance(pooling_mode, str) else "+".join(pooling_mode)
    name = name or f"st-{family}-{mode_tag}"
    hf_dir = hf_backbone(target, family, name=f"_hf-{name}")
    if tokenizer_extra:
        cfg_path = Path(hf_dir) / "tokenizer_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **tokenizer_extra}, indent=2))
    _seed()
    pooling = Pooling(HIDDEN, pooling_mode=pooling_mode, include_prompt=include_prompt)
    modules: list = [pooling]
    dim = pooling.get_embedding_dimension()
    if dense is not None:
        dense = dict(dense)
        activation = {"tanh": torch.nn.Tanh(), "identity": torch.nn.Identity(), "gelu": torch.nn.GELU(),
                      "relu": torch.nn.ReLU(), "sigmoid": torch.nn.Sigmoid()}[dense.pop("activation", "tanh")]
        out = dense.pop("out_features", 16)
        modules.append(Dense(dim, out, activation_function=activation, **dense))
        dim = out
    if layer_norm:
        ln = LayerNorm(dim)
        with torch.no_grad():
            ln.norm.weight.copy_(1.0 + 0.5 * torch.randn(dim))
            ln.norm.bias.copy_(0.5 * torch.randn(dim))
        modules.append(ln)
    if normalize:
        modules.append(Normalize())
    return _save_st(target, name, hf_dir, modules, prompts=prompts, default_prompt_name=default_prompt_name,
                    truncate_dim=truncate_dim)


def build_bert_pooling(target: str | Path, pooling_mode: str | tuple[str, ...], **kwargs) -> str:
    """BERT in the new layout with one pooling mode (or a tuple of modes, concatenated)."""
    return build_st(target, "bert", pooling_mode=pooling_mode, **kwargs)


def build_bert_prompts(target: str | Path, *, include_prompt: bool = True, pooling_mode: str | tuple[str, ...] = "mean",
                       name: str | None = None) -> str:
    """BERT + Pooling + Normalize with e5-style prompts and default_prompt_name "query"."""
    tag = "incl" if include_prompt else "excl"
    mode_tag = pooling_mode if isinstance(pooling_mode, str) else "+".join(pooling_mode)
    return build_st(target, "bert", name=name or f"st-bert-prompts-{mode_tag}-{tag}", pooling_mode=pooling_mode,
                    include_prompt=include_prompt, normalize=True, prompts=dict(E5_PROMPTS), default_prompt_name="query")


def build_bert_spaced_added_token(target: str | Path) -> str:
    """BERT + mean Pooling + Normalize over `spaced_added_token_tokenizer` (the embedding table one row
    longer, for the added token), saved by ST."""
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import BertModel

    target = Path(target)
    tok = spaced_added_token_tokenizer()
    _seed()
    hf_dir = _save_hf(BertModel(_bert_config(vocab_size=len(tok)), add_pooling_layer=False), tok,
                      _fresh(target, "_hf-st-bert-spaced-token"))
    return _save_st(target, "st-bert-spaced-token", str(hf_dir), [Pooling(HIDDEN, pooling_mode="mean"), Normalize()])


def save_prompts_as_st5(model_dir: str | Path, prompts: dict[str, str] | None) -> str:
    """Rewrites config_sentence_transformers.json's prompts as ST 2.x-5.x saved them: only the model's
    own prompts (ST 6 also saves its empty "query" / "document" placeholders); {} when None. The
    published e5 / bge models on the hub carry prompts of this form."""
    cfg_path = Path(model_dir) / "config_sentence_transformers.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["prompts"] = dict(prompts or {})
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return str(model_dir)


def build_bert_dense(target: str | Path, **dense) -> str:
    """BERT + mean Pooling + Dense (default 32 -> 16, bias, Tanh): the vector is 16 wide, not 32."""
    dense = {"out_features": 16, "bias": True, "activation": "tanh", **dense}
    return build_st(target, "bert", name="st-bert-dense", dense=dense)


def build_bert_layer_norm(target: str | Path) -> str:
    """BERT + mean Pooling + LayerNorm (random affine) + Normalize."""
    return build_st(target, "bert", name="st-bert-layernorm", layer_norm=True, normalize=True)


def build_encoder(target: str | Path, family: str, **kwargs) -> str:
    """An encoder family (distilbert, mpnet, xlmr, roberta, deberta-v2, modernbert) in the new layout,
    mean Pooling + Normalize as the published embedders of those families have."""
    kwargs.setdefault("normalize", True)
    return build_st(target, family, **kwargs)


def build_sentence_t5(target: str | Path, family: str = "t5") -> str:
    """sentence-t5 / GTR style: T5 encoder (a whole T5 checkpoint: ST loads T5EncoderModel; mT5 /
    UMT5 alike), mean Pooling, Dense 32 -> 16 without bias, Identity activation, Normalize."""
    return build_st(target, family, name=f"st-sentence-{family}",
                    dense={"out_features": 16, "bias": False, "activation": "identity"}, normalize=True)


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "<|endoftext|>")


def build_decoder_embedder(target: str | Path, family: str = "qwen3", *, prompts: dict[str, str] | None = None,
                           chat_template: bool = False) -> str:
    """Qwen3-Embedding style: a decoder backbone (qwen3, qwen2, llama, mistral), last-token Pooling,
    Normalize, the instruction prompt as "query", `<|endoftext|>` appended by the tokenizer's
    post-processor, left padding declared by the tokenizer. chat_template: the tokenizer gets one,
    so ST 6 saves a "message" modality and renders every text through the template (a prompt
    becomes a system message)."""
    extra = {"chat_template": CHAT_TEMPLATE} if chat_template else None
    return build_st(target, family, name=f"st-{family}-embedder{'-chat' if chat_template else ''}",
                    pooling_mode="lasttoken", normalize=True, prompts=dict(QWEN_PROMPTS if prompts is None else prompts),
                    tokenizer_extra=extra)


def to_half_checkpoint(model_dir: str | Path, dtype: str = "bfloat16") -> str:
    """Stores a saved model's transformer weights in `dtype` and says so in config.json's `dtype`, as
    Qwen3-Embedding and most LLM-based embedders ship: transformers 5 (and so ST 6) loads them in
    that dtype."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(model_dir)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v.to(getattr(torch, dtype)) for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    _update_json(path / "config.json", {"dtype": dtype})
    return str(path)


# --------------------------------------------------------------------------------------------------
# The older ST layout, written by hand (ST 2.x - 4.x)
# --------------------------------------------------------------------------------------------------

def build_bert_old_layout(target: str | Path, pooling_modes: tuple[str, ...] = ("mean",), *, name: str | None = None,
                          max_seq_length: int = MAX_LEN, dense: bool = False, normalize: bool = True,
                          include_prompt: bool | None = None, prompts: dict[str, str] | None = None,
                          default_prompt_name: str | None = None) -> str:
    """BERT saved as ST 2.x wrote it: `sentence_transformers.models.*` types in modules.json,
    `{"max_seq_length": 128, "do_lower_case": false}` in sentence_bert_config.json (the tokenizer's
    own model_max_length stays 512), `pooling_mode_*` flags with `word_embedding_dimension`, an
    optional LaBSE-style Dense (Tanh, weights in pytorch_model.bin) and an empty Normalize folder."""
    import torch

    path = _fresh(target, name or ("st-old-bert-" + "+".join(pooling_modes)))
    hf_bert(target, name=path.name, model_max_length=512)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    (path / "config_sentence_transformers.json").write_text(json.dumps({
        "__version__": {"sentence_transformers": "2.2.2", "transformers": "4.30.0", "pytorch": "2.0.1"},
        **({"prompts": prompts, "default_prompt_name": default_prompt_name} if prompts else {})}, indent=2))
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST_TYPES_OLD["Transformer"]}]
    # Keys in the order all-MiniLM's file has them (cls, mean, max, mean_sqrt), which is not ST's concat order.
    flags = {"word_embedding_dimension": HIDDEN}
    for mode in ("cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"):
        flags[OLD_POOLING_FLAGS[mode]] = mode in pooling_modes
    if include_prompt is not None:
        flags["include_prompt"] = include_prompt
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(flags, indent=2))
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_TYPES_OLD["Pooling"]})
    dim = HIDDEN * len(pooling_modes)
    if dense:
        _seed()
        linear = torch.nn.Linear(dim, dim)
        (path / "2_Dense").mkdir()
        (path / "2_Dense" / "config.json").write_text(json.dumps({
            "in_features": dim, "out_features": dim, "bias": True,
            "activation_function": "torch.nn.modules.activation.Tanh"}))
        torch.save({"linear.weight": linear.weight.detach().clone(), "linear.bias": linear.bias.detach().clone()},
                   path / "2_Dense" / "pytorch_model.bin")
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": ST_TYPES_OLD["Dense"]})
    if normalize:
        idx = len(modules)
        (path / f"{idx}_Normalize").mkdir()
        modules.append({"idx": idx, "name": str(idx), "path": f"{idx}_Normalize", "type": ST_TYPES_OLD["Normalize"]})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    return str(path)


def set_config(model_dir: str | Path, **values) -> None:
    """Sets keys of the transformer's config.json (a model folder saved by ST or transformers)."""
    _update_json(Path(model_dir) / "config.json", values)


def set_tokenizer_config(model_dir: str | Path, **values) -> None:
    """Sets keys of tokenizer_config.json (e.g. model_max_length)."""
    _update_json(Path(model_dir) / "tokenizer_config.json", values)


def _update_json(path: Path, values: dict) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}, indent=2))


def to_old_layout(model_dir: str | Path, *, max_seq_length: int = MAX_LEN, do_lower_case: bool = False,
                  tokenizer_max_length: int = 512) -> str:
    """Rewrites a SentenceTransformer saved by ST 6 (Transformer, Pooling, Dense, LayerNorm, Normalize)
    into the older layout in place: `sentence_transformers.models.*` types, `{"max_seq_length",
    "do_lower_case"}` in sentence_bert_config.json (and the tokenizer's model_max_length back to
    `tokenizer_max_length`, as the hub tokenizers have it), `pooling_mode_*` flags with
    `word_embedding_dimension`, no Normalize config file."""
    path = Path(model_dir)
    modules = json.loads((path / "modules.json").read_text())
    for module in modules:
        short = module["type"].rsplit(".", 1)[1]
        module["type"] = ST_TYPES_OLD[short]
        folder = path / module["path"]
        if short == "Pooling":
            cfg = json.loads((folder / "config.json").read_text())
            modes = cfg["pooling_mode"] if isinstance(cfg["pooling_mode"], list) else [cfg["pooling_mode"]]
            old = {"word_embedding_dimension": cfg["embedding_dimension"]}
            old.update({flag: mode in modes for mode, flag in OLD_POOLING_FLAGS.items()})
            old["include_prompt"] = cfg["include_prompt"]
            (folder / "config.json").write_text(json.dumps(old, indent=2))
        elif short == "Normalize":
            (folder / "config.json").unlink()
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": do_lower_case}))
    tok_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(tok_path.read_text())
    tok_cfg.pop("max_length", None)
    tok_cfg["model_max_length"] = tokenizer_max_length
    tok_path.write_text(json.dumps(tok_cfg, indent=2))
    return str(path)


# --------------------------------------------------------------------------------------------------
# Multi-vector (ColBERT) models: ST 6's MultiVectorEncoder layout and PyLate v3's
# --------------------------------------------------------------------------------------------------

COLBERT_PREFIXES = ("[Q] ", "[D] ")
COLBERT_DIM = 16


def _colbert_backbone(target: Path, family: str, name: str) -> str:
    """A backbone with PyLate's [Q] / [D] prefixes added to its tokenizer (`add_tokens`, as PyLate
    does) and its embeddings resized for them."""
    from transformers import AutoModel, AutoTokenizer

    hf_dir = hf_backbone(target, family, name=f"_hf-{name}")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.add_tokens(list(COLBERT_PREFIXES))
    tokenizer.save_pretrained(hf_dir)
    _seed()
    model = AutoModel.from_pretrained(hf_dir)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.eval().save_pretrained(hf_dir)
    return hf_dir


def build_colbert(target: str | Path, family: str = "bert", *, name: str | None = None,
                  query_expansion: dict | None = None, query_length: int | None = None,
                  document_length: int | None = 48, skiplist_words: list[str] | None = None,
                  skiplist_tasks: list[str] | None = None, keep_only_token_ids: list[int] | None = None,
                  mask: bool = True, normalize: bool = True,
                  prompts: dict[str, str] | None = None, similarity_fn_name: str | None = None) -> str:
    """A MultiVectorEncoder saved by ST 6 itself: Transformer (query_expansion, default fixed at 16
    tokens, attend False, `{}` for none; query_length; document_length), a token-level Dense
    (hidden -> 16, no bias, Identity), a MultiVectorMask (the punctuation skiplist by default;
    `mask=False`: none) and a token-level Normalize; prompts [Q] / [D] (added tokens of the tokenizer)."""
    import string

    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    target = Path(target)
    name = name or f"colbert-{family}"
    hf_dir = _colbert_backbone(target, family, name)
    expansion = {"strategy": "fixed", "length": 16} if query_expansion is None else query_expansion or None
    first = Transformer(hf_dir, query_expansion=expansion, query_length=query_length, document_length=document_length)
    _seed()
    modules = [first, Dense(HIDDEN, COLBERT_DIM, bias=False, activation_function=torch.nn.Identity(),
                            module_input_name="token_embeddings")]
    if mask:
        words = list(string.punctuation) if skiplist_words is None else skiplist_words
        modules.append(MultiVectorMask(skiplist_words=words, skiplist_tasks=skiplist_tasks,
                                       keep_only_token_ids=keep_only_token_ids))
    if normalize:
        modules.append(Normalize(module_input_name="token_embeddings"))
    prompts = dict(zip(("query", "document"), COLBERT_PREFIXES)) if prompts is None else prompts
    path = _fresh(target, name)
    MultiVectorEncoder(modules=modules, prompts=prompts, similarity_fn_name=similarity_fn_name, device="cpu").save(str(path))
    shutil.rmtree(hf_dir)
    return str(path)


def build_pylate_colbert(target: str | Path, family: str = "bert", *, name: str | None = None,
                         query_length: int = 16, document_length: int = 48, attend_to_expansion_tokens: bool = False,
                         skiplist_words: list[str] | None = None, max_seq_length: int = 100) -> str:
    """A ColBERT model laid out as PyLate v3 saves it (pylate cannot be installed next to ST 6):
    the transformer's files at the root, modules.json [Transformer, pylate Dense], the Dense's
    config and `linear.weight`, and in config_sentence_transformers.json model_type "ColBERT" with
    query_prefix / document_prefix (added tokens), query_length, document_length,
    attend_to_expansion_tokens, do_query_expansion and skiplist_words (punctuation by default)."""
    import string

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    target = Path(target)
    name = name or f"pylate-{family}"
    hf_dir = _colbert_backbone(target, family, name)
    path = _fresh(target, name)
    AutoModel.from_pretrained(hf_dir).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(path)
    shutil.rmtree(hf_dir)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}], indent=2))
    dense = path / "1_Dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"in_features": HIDDEN, "out_features": COLBERT_DIM, "bias": False,
                                                   "activation_function": "torch.nn.modules.linear.Identity",
                                                   "use_residual": False}, indent=2))
    _seed()
    save_file({"linear.weight": torch.randn(COLBERT_DIM, HIDDEN) * 0.3}, str(dense / "model.safetensors"))
    query_prefix, document_prefix = COLBERT_PREFIXES
    (path / "config_sentence_transformers.json").write_text(json.dumps({
        "__version__": {"sentence_transformers": "4.0.2", "transformers": "4.48.2", "pytorch": "2.5.1"},
        "prompts": {}, "default_prompt_name": None, "similarity_fn_name": "MaxSim",
        "query_prefix": query_prefix, "document_prefix": document_prefix, "query_length": query_length,
        "document_length": document_length, "attend_to_expansion_tokens": attend_to_expansion_tokens,
        "skiplist_words": list(string.punctuation) if skiplist_words is None else skiplist_words,
        "do_query_expansion": True, "model_type": "ColBERT"}, indent=2))
    return str(path)


# --------------------------------------------------------------------------------------------------
# Rerankers
# --------------------------------------------------------------------------------------------------

def build_cross_encoder(target: str | Path, num_labels: int = 1, *, family: str = "bert", name: str | None = None) -> str:
    """A cross-encoder saved by ST 6's `CrossEncoder.save`: a *ForSequenceClassification checkpoint,
    modules.json with one Transformer (transformer_task "sequence-classification") and
    `"activation_fn"` in config_sentence_transformers.json (Sigmoid for 1 label, Identity otherwise)."""
    from sentence_transformers import CrossEncoder

    target = Path(target)
    name = name or f"ce-{family}-{num_labels}"
    if family == "bert":
        hf_dir = hf_bert(target, name=f"_hf-{name}", head="seq-cls", num_labels=num_labels)
    else:
        hf_dir = _hf_seq_cls(target, family, f"_hf-{name}", num_labels)
    path = _fresh(target, name)
    CrossEncoder(hf_dir, device="cpu", max_length=MAX_LEN).save(str(path))
    shutil.rmtree(hf_dir)
    return str(path)


def _hf_seq_cls(target: Path, family: str, name: str, num_labels: int) -> str:
    import transformers as tf

    path = _fresh(target, name)
    _seed()
    if family == "xlmr":
        tok = xlmr_tokenizer()
        cfg = tf.XLMRobertaConfig(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=MAX_LEN + 2, type_vocab_size=1,
                                  pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=num_labels,
                                  initializer_range=INIT_RANGE)
        return str(_save_hf(tf.XLMRobertaForSequenceClassification(cfg), tok, path))
    if family == "deberta-v2":
        # DeBERTa-v3 NLI cross-encoders' shape: the tokenizer gives token types, the model has no
        # token-type embeddings (type_vocab_size 0), so they change nothing.
        tok = deberta_tokenizer()
        cfg = tf.DebertaV2Config(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=512, type_vocab_size=0,
                                 relative_attention=True, position_buckets=32, max_relative_positions=-1,
                                 pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm",
                                 share_att_key=True, pad_token_id=0, num_labels=num_labels,
                                 initializer_range=INIT_RANGE)
        return str(_save_hf(tf.DebertaV2ForSequenceClassification(cfg), tok, path))
    raise ValueError(f"no sequence-classification builder for {family!r}")


def build_causal_reranker(target: str | Path, name: str = "ce-qwen3-causal") -> str:
    """Qwen3-Reranker's shape, saved by ST 6's CrossEncoder: a Qwen3ForCausalLM (Transformer with
    transformer_task "text-generation", left padding) + LogitScore (logit of " yes" minus logit of
    " no" at the last position), Sigmoid activation."""
    import transformers as tf
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules import LogitScore

    target = Path(target)
    hf_dir = _fresh(target, f"_hf-{name}")
    tok = qwen_tokenizer()
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    _seed()
    cfg = tf.Qwen3Config(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
                         pad_token_id=eot, eos_token_id=eot, tie_word_embeddings=False, initializer_range=INIT_RANGE)
    _save_hf(tf.Qwen3ForCausalLM(cfg), tok, hf_dir)
    yes, no = (tok(word, add_special_tokens=False)["input_ids"][0] for word in (" yes", " no"))
    path = _fresh(target, name)
    CrossEncoder(modules=[Transformer(str(hf_dir), transformer_task="text-generation"),
                          LogitScore(true_token_id=yes, false_token_id=no)], device="cpu").save(str(path))
    shutil.rmtree(hf_dir)
    return str(path)


# LLM rerankers' chat templates: the pair arrives as a "query" and a "document" message (ST 6's
# pair_to_messages), a prompt as a "system" message. Qwen3-Reranker's layout reads flat contents
# (strings); mxbai-rerank-v2's reads structured ones ([{"type": "text", "text": ...}]).
QWEN3_RERANKER_TEMPLATE = (
    '{%- set ns = namespace(q="", d="", s="Given a web search query, retrieve relevant passages that answer the query") -%}'
    '{%- for m in messages -%}'
    '{%- if m.role == "query" %}{% set ns.q = m.content %}'
    '{%- elif m.role == "document" %}{% set ns.d = m.content %}'
    '{%- elif m.role == "system" %}{% set ns.s = m.content %}{% endif -%}'
    '{%- endfor -%}'
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    '<Instruct>: {{ ns.s }}\n<Query>: {{ ns.q }}\n<Document>: {{ ns.d }}<|im_end|>\n'
    '{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}')
MXBAI_RERANKER_TEMPLATE = (
    '{%- set ns = namespace(q="", d="", s="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.") -%}'
    '{%- for m in messages -%}'
    '{%- if m.role == "query" %}{% set ns.q = m.content[0].text %}'
    '{%- elif m.role == "document" %}{% set ns.d = m.content[0].text %}'
    '{%- elif m.role == "system" %}{% set ns.s = m.content[0].text %}{% endif -%}'
    '{%- endfor -%}'
    '<|im_start|>system\n{{ ns.s }}<|im_end|>\n<|im_start|>user\nquery: {{ ns.q }}\ndocument: {{ ns.d }}\n'
    'You are a search relevance expert who evaluates how well documents match search queries. '
    'Answer 0 for not relevant, 1 for relevant.\nRelevance:<|im_end|>\n'
    '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')


def build_llm_reranker(target: str | Path, style: str = "qwen3", *, single_token: bool = False,
                       prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
                       name: str | None = None) -> str:
    """An LLM reranker saved by ST 6's CrossEncoder: a causal LM (Transformer, transformer_task
    "text-generation") + LogitScore, Sigmoid activation, the pair rendered through a chat template
    ("message" modality, add_generation_prompt from processing_kwargs).

    style "qwen3": Qwen3-Reranker's shape -- Qwen3ForCausalLM, flat messages, "yes" / "no" logits;
    "mxbai": mxbai-rerank-v2's -- Qwen2ForCausalLM, structured messages, "1" / "0" logits.
    single_token: LogitScore reads the true token's logit alone (false_token_id None, as zerank-2).
    """
    import transformers as tf
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules import LogitScore

    target = Path(target)
    name = name or f"ce-{style}-llm{'-single' if single_token else ''}"
    hf_dir = _fresh(target, f"_hf-{name}")
    tok = qwen_tokenizer()
    tok.chat_template = QWEN3_RERANKER_TEMPLATE if style == "qwen3" else MXBAI_RERANKER_TEMPLATE
    # The template's own text is ~70 tokens of this tiny BPE: room for query and document, and the
    # tests' long documents still overflow (truncated, the template's suffix restored by ST).
    tok.model_max_length = LLM_RERANKER_MAX_LEN
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    _seed()
    common = dict(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512, pad_token_id=eot,
                  eos_token_id=eot, tie_word_embeddings=False, initializer_range=INIT_RANGE)
    if style == "qwen3":
        model, words = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=8, **common)), ("yes", "no")
    elif style == "mxbai":
        model, words = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)), ("1", "0")
    else:
        raise ValueError(f"unknown LLM reranker style {style!r}")
    _save_hf(model, tok, hf_dir)
    true_id, false_id = (tok(word, add_special_tokens=False)["input_ids"][0] for word in words)
    path = _fresh(target, name)
    transformer = Transformer(str(hf_dir), transformer_task="text-generation",
                              processing_kwargs={"chat_template": {"add_generation_prompt": True}})
    score = LogitScore(true_token_id=true_id, false_token_id=None if single_token else false_id)
    CrossEncoder(modules=[transformer, score], device="cpu", prompts=prompts,
                 default_prompt_name=default_prompt_name).save(str(path))
    shutil.rmtree(hf_dir)
    return str(path)


def build_hf_reranker(target: str | Path, num_labels: int = 1, *, activation: str | None = None,
                      name: str | None = None) -> str:
    """A reranker as older ones are published: a plain HF BertForSequenceClassification dir, no
    modules.json. `activation`: None (ST's default: Sigmoid for 1 label), or a dotted class written
    where ST < 4 wrote it (`sbert_ce_default_activation_function` in config.json), e.g.
    "torch.nn.modules.linear.Identity" as the ms-marco cross-encoders had."""
    path = Path(hf_bert(target, name=name or f"hf-reranker-{num_labels}", head="seq-cls", num_labels=num_labels))
    if activation is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["sbert_ce_default_activation_function"] = activation
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(path)


# --------------------------------------------------------------------------------------------------
# SPLADE
# --------------------------------------------------------------------------------------------------

def build_splade(target: str | Path, pooling_strategy: str = "max", *, activation_function: str = "relu",
                 max_active_dims: int | None = None, old_layout: bool = False, name: str | None = None) -> str:
    """A SparseEncoder saved by ST 6: a BertForMaskedLM checkpoint, Transformer (transformer_task
    "fill-mask") + SpladePooling (`pooling_strategy` max or sum, `activation_function`), optional
    max_active_dims (top-k) in config_sentence_transformers.json. old_layout: modules.json names the
    ST 5 classes (`sentence_transformers.sparse_encoder.models.MLMTransformer` / `.SpladePooling`)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    target = Path(target)
    name = name or f"splade-{pooling_strategy}{'-top' + str(max_active_dims) if max_active_dims else ''}"
    hf_dir = hf_bert(target, name=f"_hf-{name}", head="mlm")
    path = _save_st(target, name, hf_dir, [SpladePooling(pooling_strategy, activation_function=activation_function)],
                    model_cls=SparseEncoder, transformer_task="fill-mask", max_active_dims=max_active_dims)
    if old_layout:
        modules_path = Path(path) / "modules.json"
        modules = json.loads(modules_path.read_text())
        modules[0]["type"] = ST_TYPES_OLD["MLMTransformer"]
        modules[1]["type"] = ST_TYPES_OLD["SpladePooling"]
        modules_path.write_text(json.dumps(modules, indent=2))
    return path


# --------------------------------------------------------------------------------------------------
# Router (asymmetric query / document models)
# --------------------------------------------------------------------------------------------------

def build_inference_free_splade(target: str | Path, *, name: str = "splade-inference-free",
                                max_active_dims: int | None = None) -> str:
    """opensearch-neural-sparse-encoding-doc-v3-distill's shape, saved by ST 6:
    Router.for_query_document (default route "document") with a query route of one
    SparseStaticEmbedding (a random non-negative weight per vocabulary id, a fifth of them 0, with the
    document MLM's tokenizer) and a document route of MLMTransformer + SpladePooling(max, log1p_relu)."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SparseStaticEmbedding, SpladePooling

    target = Path(target)
    path = _fresh(target, name)
    hf_dir = hf_bert(target, name=f"_hf-{name}", head="mlm")
    document = MLMTransformer(hf_dir)
    _seed()
    weight = torch.rand(len(document.tokenizer.get_vocab())) * 3
    weight[torch.rand(weight.shape) < 0.2] = 0.0
    query = SparseStaticEmbedding(document.tokenizer, weight=weight, frozen=True)
    router = Router.for_query_document(query_modules=[query],
                                       document_modules=[document, SpladePooling("max", activation_function="log1p_relu")])
    SparseEncoder(modules=[router], device="cpu", similarity_fn_name="dot", max_active_dims=max_active_dims).save(str(path))
    shutil.rmtree(hf_dir)
    return str(path)


def build_router_dense(target: str | Path, *, name: str = "router-dense", two_transformers: bool = False,
                       sub_modules_names: tuple[str, str] = ("query", "document"), default_route: str | None = "document",
                       allow_empty_key: bool = True, route_mappings: dict | None = None) -> str:
    """An asymmetric dense SentenceTransformer saved by ST 6: Router({query route, document route})
    then Normalize. Both routes share one BERT Transformer and its mean Pooling (ST saves the shared
    module once) and end in their own Dense (32 -> 16, Tanh); `two_transformers` gives the query
    route a BERT of its own (other weights, same tokenizer). `sub_modules_names`, `default_route`,
    `allow_empty_key` and `route_mappings` are the Router's."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Router, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    target = Path(target)
    path = _fresh(target, name)
    hf_dir = hf_bert(target, name=f"_hf-{name}")
    document_transformer = Transformer(hf_dir)
    query_transformer = document_transformer
    if two_transformers:
        query_transformer = Transformer(hf_dir)
        torch.manual_seed(SEED + 1)
        with torch.no_grad():
            for param in query_transformer.auto_model.parameters():
                param.add_(0.1 * torch.randn_like(param))
    _seed()
    pooling = Pooling(HIDDEN, pooling_mode="mean")
    query_name, document_name = sub_modules_names
    router = Router({query_name: [query_transformer, pooling, Dense(HIDDEN, 16, activation_function=torch.nn.Tanh())],
                     document_name: [document_transformer, pooling, Dense(HIDDEN, 16, activation_function=torch.nn.Tanh())]},
                    default_route=default_route, allow_empty_key=allow_empty_key, route_mappings=route_mappings)
    SentenceTransformer(modules=[router, Normalize()], device="cpu").save(str(path))
    shutil.rmtree(hf_dir)
    return str(path)


# --------------------------------------------------------------------------------------------------
# Static embeddings (model2vec / potion, ST's static-retrieval models)
# --------------------------------------------------------------------------------------------------

STATIC_DIM = 24


def _static_tokenizer(truncation: int | None):
    """The bundled WordPiece tokenizer.json as `tokenizers` loads it (what ST's StaticEmbedding
    keeps): its saved truncation replaced by `truncation` kept tokens, or none."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(_bundled_dir() / "tokenizer.json"))
    tokenizer.no_padding()
    if truncation is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_length=truncation)
    return tokenizer


def build_static(target: str | Path, *, name: str = "static-embedding", normalize: bool = False,
                 truncation: int | None = None, dense: bool = False, truncate_dim: int | None = None) -> str:
    """A StaticEmbedding model saved by ST 6 (static-retrieval-mrl's shape): the bundled WordPiece
    tokenizer (`truncation`: the kept tokens its tokenizer.json saves, None for none), a random
    [vocabulary, 24] table, then an optional Dense (24 -> 16, Tanh) and Normalize."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    path = _fresh(target, name)
    tokenizer = _static_tokenizer(truncation)
    _seed()
    static = StaticEmbedding(tokenizer, embedding_weights=torch.randn(tokenizer.get_vocab_size(), STATIC_DIM))
    modules: list = [static]
    if dense:
        modules.append(Dense(STATIC_DIM, 16, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu", truncate_dim=truncate_dim).save(str(path))
    return str(path)


def build_model2vec(target: str | Path, *, name: str = "model2vec-potion", normalize: bool = True) -> str:
    """A folder as model2vec's StaticModel.save_pretrained writes it (potion models): config.json
    (model_type model2vec), model.safetensors with `embeddings` (fewer rows than the vocabulary),
    `mapping` (token id -> row) and per-token `weights`, tokenizer.json at the top, and the
    modules.json ST loads it with (StaticEmbedding at ".", then Normalize)."""
    import torch
    from safetensors.torch import save_file

    path = _fresh(target, name)
    path.mkdir(parents=True)
    tokenizer = _static_tokenizer(None)
    vocab = tokenizer.get_vocab_size()
    _seed()
    rows = vocab // 3
    save_file({"embeddings": torch.randn(rows, STATIC_DIM), "mapping": torch.randint(0, rows, (vocab,)),
               "weights": torch.rand(vocab) + 0.25}, str(path / "model.safetensors"))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"model_type": "model2vec", "architectures": ["StaticModel"],
                                                  "tokenizer_name": "bundled-wordpiece", "apply_pca": STATIC_DIM,
                                                  "apply_zipf": True, "hidden_dim": STATIC_DIM, "seq_length": 1000000,
                                                  "normalize": normalize}, indent=2))
    modules = [{"idx": 0, "name": "0", "path": ".", "type": "sentence_transformers.models.StaticEmbedding"}]
    if normalize:
        (path / "1_Normalize").mkdir()
        modules.append({"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    return str(path)


def build_router_static_query(target: str | Path, *, name: str = "router-static-query") -> str:
    """An inference-free dense retriever saved by ST 6: Router.for_query_document with a query route
    of one StaticEmbedding (the document model's tokenizer, its saved truncation at 128 included) and
    a document route of BERT + mean Pooling, both 32 wide, then Normalize."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Router, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling, StaticEmbedding

    target = Path(target)
    path = _fresh(target, name)
    hf_dir = hf_bert(target, name=f"_hf-{name}")
    document = Transformer(hf_dir)
    _seed()
    tokenizer = _static_tokenizer(MAX_LEN)
    query = StaticEmbedding(tokenizer, embedding_weights=torch.randn(tokenizer.get_vocab_size(), HIDDEN))
    router = Router.for_query_document(query_modules=[query], document_modules=[document, Pooling(HIDDEN, "mean")])
    SentenceTransformer(modules=[router, Normalize()], device="cpu").save(str(path))
    shutil.rmtree(hf_dir)
    return str(path)


# --------------------------------------------------------------------------------------------------
# Hub ids
# --------------------------------------------------------------------------------------------------

def lay_out_hf_cache(model_dir: str | Path, hf_home: str | Path, repo_id: str = "zoo-org/tiny-model",
                     revision: str = "0123456789abcdef0123456789abcdef01234567") -> str:
    """Lays `model_dir` out as the Hugging Face cache does: files under `blobs/` (named by a hash of
    their content), `snapshots/<revision>/...` as relative symlinks to them, `refs/main` holding the
    revision. With HF_HOME=hf_home and HF_HUB_OFFLINE=1, `repo_id` resolves to the snapshot. Returns
    the snapshot folder."""
    import hashlib
    import os

    repo = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for src in sorted(Path(model_dir).rglob("*")):
        if not src.is_file():
            continue
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        dest = snapshot / src.relative_to(model_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.symlink_to(os.path.relpath(blob, dest.parent))
    return str(snapshot)


def lay_out_broken_hf_cache(hf_home: str | Path, repo_id: str = "zoo-org/broken-model") -> str:
    """A cache repo folder as an interrupted download leaves it: `blobs/` and `refs/`, no `snapshots/`."""
    repo = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("0" * 40)
    return str(repo)


def add_unknown_module(model_dir: str | Path, type_name: str = "my_pkg.WeirdModule") -> str:
    """Appends a module of a type nobody implements to a saved model's modules.json."""
    path = Path(model_dir) / "modules.json"
    modules = json.loads(path.read_text())
    idx = len(modules)
    folder = Path(model_dir) / f"{idx}_WeirdModule"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"strength": 3}))
    modules.append({"idx": idx, "name": str(idx), "path": folder.name, "type": type_name})
    path.write_text(json.dumps(modules, indent=2))
    return str(model_dir)


# Dual encoders (images): CLIP and SigLIP, tiny towers at the real 224 px input


def _clip_text_tokenizer():
    """CLIP's shape: byte-level BPE with <s> ... </s>, cut at CLIP's 77 positions."""
    tok = roberta_tokenizer()
    tok.model_max_length = 77
    return tok


def build_clip(target: str | Path, layout: str = "st", normalize: bool = False, name: str | None = None) -> str:
    """A tiny CLIP (text and vision towers, hidden 32, 2 layers, 224 px images in 32 px patches) with
    transformers' PIL image processor, saved as `layout`: "st" (ST 6's Transformer module with its
    modality config), "plain" (a transformers folder, no ST files) or "legacy" (the CLIPModel
    module of older clip-ViT-* saves: a 0_CLIPModel folder with preprocessor_config.json); a
    Normalize module after it when `normalize`."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    _seed()
    tok = _clip_text_tokenizer()
    towers = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(text_config=dict(vocab_size=len(tok), max_position_embeddings=77, eos_token_id=tok.eos_token_id,
                                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, **towers),
                        vision_config=dict(image_size=224, patch_size=32, **towers), projection_dim=16)
    with torch.no_grad():
        model = CLIPModel(config).eval()
    processor = CLIPProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tok)
    return _save_dual_encoder(Path(target), name or f"clip-{layout}", model, processor, layout, normalize)


def _siglip_text() -> tuple:
    """SigLIP's and SigLIP2's text side (seeded): a T5-style Unigram tokenizer cut at 64 tokens, its
    text tower's config, and both towers' tiny sizes."""
    _seed()
    tok = t5_tokenizer()
    tok.model_max_length = 64
    towers = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    text = dict(vocab_size=len(tok), max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=None, **towers)
    return tok, text, towers


def build_siglip(target: str | Path, name: str = "siglip") -> str:
    """A tiny SigLIP (fixed 224 px, 16 px patches, no class token; mean/std 0.5) with a T5-style
    Unigram tokenizer, saved by ST 6."""
    import torch
    from transformers import SiglipConfig, SiglipImageProcessorPil, SiglipModel, SiglipProcessor

    tok, text, towers = _siglip_text()
    config = SiglipConfig(text_config=text, vision_config=dict(image_size=224, patch_size=16, **towers))
    with torch.no_grad():
        model = SiglipModel(config).eval()
    processor = SiglipProcessor(image_processor=SiglipImageProcessorPil(), tokenizer=tok)
    return _save_dual_encoder(Path(target), name, model, processor, "st", False)


def build_siglip2(target: str | Path, name: str = "siglip2", max_num_patches: int = 64) -> str:
    """A tiny SigLIP2 with its NaFlex processor (images keep their aspect ratio in up to 256 patches
    of 16 px as Siglip2Processor calls it, whatever `max_num_patches` its image processor saves) and
    a T5-style Unigram tokenizer, saved by ST 6."""
    import torch
    from transformers import Siglip2Config, Siglip2ImageProcessorPil, Siglip2Model, Siglip2Processor

    tok, text, towers = _siglip_text()
    config = Siglip2Config(text_config=text, vision_config=dict(patch_size=16, num_patches=64, **towers))
    with torch.no_grad():
        model = Siglip2Model(config).eval()
    processor = Siglip2Processor(image_processor=Siglip2ImageProcessorPil(max_num_patches=max_num_patches, patch_size=16),
                                 tokenizer=tok)
    return _save_dual_encoder(Path(target), name, model, processor, "st", False)


def build_clap(target: str | Path, name: str = "clap", layout: str = "st", normalize: bool = False) -> str:
    """A tiny CLAP (a RoBERTa-style text tower and an HTS-AT audio tower, hidden 32, over the real
    48 kHz, 10 s, 64-mel feature extractor without fusion, as laion/clap-htsat-unfused) saved as
    `layout`: "st" (ST 6's Transformer module with the modality config it derives) or "plain"."""
    import torch
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor

    _seed()
    tok = roberta_tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=80, pad_token_id=tok.pad_token_id)
    audio = dict(hidden_size=32, patch_embeds_hidden_size=16, depths=[1, 1], num_attention_heads=[2, 2], window_size=8,
                 spec_size=256, num_mel_bins=64, enable_fusion=False)
    with torch.no_grad():
        model = ClapModel(ClapConfig(text_config=text, audio_config=audio, projection_dim=16)).eval()
    extractor = ClapFeatureExtractor(feature_size=64, sampling_rate=48000, hop_length=480, max_length_s=10,
                                     truncation="rand_trunc", padding="repeatpad")
    processor = ClapProcessor(feature_extractor=extractor, tokenizer=tok)
    return _save_dual_encoder(Path(target), name, model, processor, layout, normalize)


def build_colpali(target: str | Path, name: str = "colpali", layout: str = "st",
                  keep_only_image_tokens: bool = False, image_size: int = 28, patch_size: int = 14,
                  vision: dict | None = None, text: dict | None = None, embedding_dim: int = 16) -> str:
    """A tiny ColPali page retriever (PaliGemma: a 1-layer SigLIP vision tower on 28 px images in
    14 px patches, 4 image tokens; a 2-layer Gemma) with ColPaliProcessor (a Gemma-style BPE
    tokenizer with Gemma's special ids, SiglipImageProcessor), saved as `layout`: "st"
    (MultiVectorEncoder's save: Transformer with transformer_task "retrieval" and a MultiVectorMask,
    keeping only the image tokens of documents when `keep_only_image_tokens`) or "plain". `vision` /
    `text` override the towers' sizes (scripts/tiny_models.py builds a benchmark-sized one)."""
    import torch
    from sentence_transformers import MultiVectorEncoder
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import (
        ColPaliConfig,
        ColPaliForRetrieval,
        ColPaliProcessor,
        GemmaConfig,
        GemmaTokenizer,
        PaliGemmaConfig,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    _seed()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
    chars = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;?!'-\n")
    words = ["\u2581Question", ":", "\u2581Describe", "\u2581the", "\u2581image", ".", "\u2581what", "\u2581is",
             "\u2581a", "\u2581cat", "\u2581dog", "\u2581page", "\u2581report", "\u2581revenue", "?"]
    vocab: dict[str, int] = {}
    for token in specials + words + ["\u2581"] + chars + ["\u2581" + c for c in chars]:
        vocab.setdefault(token, len(vocab))
    merges, seen = [], set()
    for word in words:
        current = word[0]
        for piece in word[1:]:
            if (current, piece) not in seen:
                seen.add((current, piece))
                merges.append((current, piece))
            current += piece
            vocab.setdefault(current, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")  # Gemma: spaces as "\u2581", no dummy prefix
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.decoder = decoders.Replace("\u2581", " ")
    hf_tok = GemmaTokenizer(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>", add_bos_token=False, add_eos_token=False, padding_side="right")
    hf_tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    # (do_convert_rgb left unset, as ColPali's saved configs leave it: ColPaliProcessor asks it on every call)
    image_processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size}, resample=3,
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image_processor.image_seq_length = (image_size // patch_size) ** 2
    processor = ColPaliProcessor(image_processor=image_processor, tokenizer=hf_tok)
    vocab_size = len(processor.tokenizer)
    text_sizes = {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 16, **(text or {})}
    vision_sizes = {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                    **(vision or {})}
    text_config = GemmaConfig(vocab_size=vocab_size, max_position_embeddings=max(256, 4 * image_size), pad_token_id=0,
                              bos_token_id=2, eos_token_id=1, **text_sizes)
    vision_config = SiglipVisionConfig(image_size=image_size, patch_size=patch_size, vision_use_head=False, **vision_sizes)
    vlm = PaliGemmaConfig(vision_config=vision_config, text_config=text_config, image_token_index=4,
                          vocab_size=vocab_size, projection_dim=text_sizes["hidden_size"],
                          hidden_size=text_sizes["hidden_size"], pad_token_id=0)
    with torch.no_grad():
        model = ColPaliForRetrieval(ColPaliConfig(vlm_config=vlm, embedding_dim=embedding_dim)).eval()
        for p in model.parameters():  # (above the init's 0.02, so that inputs move the vectors)
            p.normal_(0, 0.2)
    out = _fresh(Path(target), name)
    hf_dir = out / "hf"
    model.save_pretrained(hf_dir)
    processor.save_pretrained(hf_dir)
    if layout == "plain":
        return str(hf_dir)
    encoder = MultiVectorEncoder(str(hf_dir), device="cpu")
    encoder.save(str(out / "st"))
    if keep_only_image_tokens:
        mask = out / "st" / "1_MultiVectorMask" / "config.json"
        config = json.loads(mask.read_text())
        config["keep_only_token_ids"] = [4]
        mask.write_text(json.dumps(config))
    return str(out / "st")


def _save_dual_encoder(target: Path, name: str, model, processor, layout: str, normalize: bool) -> str:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer

    out = _fresh(target, name)
    hf_dir = out / "hf" if layout != "plain" else out
    model.save_pretrained(hf_dir)
    processor.save_pretrained(hf_dir)
    if layout == "plain":
        return str(out)
    if layout == "st":
        modules = [Transformer(str(hf_dir))] + ([Normalize()] if normalize else [])
        SentenceTransformer(modules=modules).save(str(out / "st"))
        shutil.rmtree(hf_dir)
        return str(out / "st")
    # legacy: modules.json naming sentence_transformers.models.CLIPModel, preprocessor_config.json
    legacy = out / "legacy"
    shutil.copytree(hf_dir, legacy / "0_CLIPModel")
    processor_config = legacy / "0_CLIPModel" / "processor_config.json"
    (legacy / "0_CLIPModel" / "preprocessor_config.json").write_text(
        json.dumps(json.loads(processor_config.read_text())["image_processor"], indent=2))
    processor_config.unlink()
    modules = [{"idx": 0, "name": "0", "path": "0_CLIPModel", "type": "sentence_transformers.models.CLIPModel"}]
    if normalize:
        (legacy / "1_Normalize").mkdir()
        modules.append({"idx": 1, "name": "1", "path": "1_Normalize", "type": ST_TYPES_OLD["Normalize"]})
    (legacy / "modules.json").write_text(json.dumps(modules, indent=2))
    shutil.rmtree(hf_dir)
    return str(legacy)
