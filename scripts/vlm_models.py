"""Tiny VLM embedders for the tests, built offline with transformers' own classes (Qwen2-VL and
Qwen3-VL: 2-layer text models of width 64, 2-layer vision towers on 4-pixel patches merged 2 x 2,
images resized to between 2 x 2 and 6 x 6 merged groups) and the processors transformers ships
(Qwen2VLProcessor / Qwen3VLProcessor: Qwen2VLImageProcessor, the video processor, a byte-level BPE
tokenizer with Qwen's special tokens, a chat template), saved by sentence-transformers' own
Transformer, Pooling ("lasttoken") and Normalize modules, as ST 6.3 saves a Qwen3-VL-Embedding.
transformers 5 loads these processors only where torchvision is installed."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

# Faithful copy of Qwen/Qwen2-VL-7B-Instruct chat_template (default system prompt
# "You are a helpful assistant." injected when the first message is not a system message).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL-Embedding style template: same ChatML layout but the default system prompt is
# "Represent the user's input." (as in Qwen/Qwen3-VL-Embedding-*), no tool/think machinery.
QWEN3_VL_EMBEDDING_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nRepresent the user's input.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen's special tokens, in Qwen's own order (ids are contiguous right after the BPE vocab,
# exactly like 151643.. in the real tokenizer).
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",  # +0  pad / bos
    "<|im_start|>",  # +1
    "<|im_end|>",  # +2  eos
    "<|object_ref_start|>",  # +3
    "<|object_ref_end|>",  # +4
    "<|box_start|>",  # +5
    "<|box_end|>",  # +6
    "<|quad_start|>",  # +7
    "<|quad_end|>",  # +8
    "<|vision_start|>",  # +9
    "<|vision_end|>",  # +10
    "<|vision_pad|>",  # +11
    "<|image_pad|>",  # +12
    "<|video_pad|>",  # +13
]

TRAIN_SENTENCES = [
    "You are a helpful assistant.",
    "Represent the user's input.",
    "The quick brown fox jumps over the lazy dog.",
    "A photo of a cat sitting on a red sofa.",
    "Sentence transformers compute dense embeddings for text and images.",
    "What is the capital of France? Paris is the capital of France.",
    "user assistant system query document picture video image text",
    "Retrieve images or text relevant to the user's query.",
    "0123456789 !?.,;:'\"()[]{}<>-_=+*/\\ \n\t",
]


def build_tokenizer(vocab_size: int = 384):
    """Byte-level BPE trained on a few sentences, with Qwen's pre-tokenizer / normalizer / decoder,
    wrapped as Qwen2TokenizerFast (== Qwen2Tokenizer in transformers 5)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(TRAIN_SENTENCES * 4, trainer=trainer)
    tok.add_special_tokens(QWEN_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}

    hf_tok = Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=32768,
        extra_special_tokens=None,
    )
    return hf_tok, ids


def _tiny_image_kwargs(patch_size: int, merge_size: int, temporal_patch_size: int = 2):
    factor = patch_size * merge_size
    return dict(
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=merge_size,
        min_pixels=(2 * factor) ** 2,  # at least a 2x2 grid of merged tokens
        max_pixels=(6 * factor) ** 2,  # at most 6x6 = 36 merged tokens (144 patches)
    )


def _finish_with_st(hf_dir: str, folder: str, processing_kwargs: dict | None, prompts: dict | None = None) -> str:
    """Load the HF checkpoint with ST modules built explicitly, then save with ST's own save()."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    # AutoModel loads Qwen2VLModel from the *ForConditionalGeneration checkpoint: the "lm_head.weight
    # UNEXPECTED" load report is expected, so keep transformers quiet here.
    transformers.logging.set_verbosity_error()
    transformer = Transformer(
        hf_dir,
        transformer_task="feature-extraction",
        processing_kwargs=processing_kwargs,
        unpad_inputs=False,  # qwen2_vl does not support unpadded (FA2 varlen) inputs
        model_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
    )
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    model = SentenceTransformer(
        modules=[transformer, pooling, Normalize()], device="cpu", prompts=prompts, similarity_fn_name="cosine"
    )
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    model.save(folder)
    return folder


def _tiny_qwen2vl_config(ids: dict, vocab_size: int):
    """The tiny Qwen2-VL every builder here starts from: a 2-layer text model of width 64 (head_dim 16:
    rotary half 8 = sum(mrope_section)), a 2-layer vision tower on 4-pixel patches merged 2 x 2."""
    from transformers import Qwen2VLConfig

    patch, merge, tpatch, hidden = 4, 2, 2, 64
    return Qwen2VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=hidden, mlp_ratio=2, num_heads=2, in_channels=3,
                           patch_size=patch, spatial_merge_size=merge, temporal_patch_size=tpatch),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)


def build_qwen2vl_embedder(folder: str, seed: int = 0) -> str:
    """Build a tiny random Qwen2-VL embedding model in ``folder`` (ST 6.3 layout). Returns ``folder``."""
    from transformers import (
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(seed)
    tokenizer, ids = build_tokenizer()
    vocab_size = len(tokenizer)
    patch, merge, tpatch = 4, 2, 2

    config = _tiny_qwen2vl_config(ids, vocab_size)
    model = Qwen2VLForConditionalGeneration(config).eval()

    image_processor = Qwen2VLImageProcessor(**_tiny_image_kwargs(patch, merge, tpatch))
    video_processor = Qwen2VLVideoProcessor(**_tiny_image_kwargs(patch, merge, tpatch))
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )

    with tempfile.TemporaryDirectory(prefix="tiny_qwen2vl_hf_") as hf_dir:
        model.save_pretrained(hf_dir)
        processor.save_pretrained(hf_dir)
        return _finish_with_st(
            hf_dir,
            folder,
            # Qwen3-VL-Embedding / GME style: prefill "<|im_start|>assistant\n" so the last token is fixed
            processing_kwargs={"chat_template": {"add_generation_prompt": True}},
            prompts={"query": "Retrieve images or text relevant to the user's query.", "document": ""},
        )


# The benchmark's model (scripts/bench_vlm.py): Qwen3-VL-Embedding's input -- 16-pixel patches merged
# 2 x 2 (32 pixels a vision token), up to 1,280 vision tokens an image -- on small random towers (the
# real 2B model takes seconds an image on this CPU).
BENCH_SIZES = {"patch": 16, "hidden": 256, "layers": 4, "heads": 4, "head_dim": 64, "mrope_section": [8, 12, 12],
               "vision_depth": 4, "vision_hidden": 256, "positions": 2304, "min_tokens": 4, "max_tokens": 1280}
TINY_SIZES = {"patch": 4, "hidden": 64, "layers": 2, "heads": 4, "head_dim": 16, "mrope_section": [2, 3, 3],
              "vision_depth": 2, "vision_hidden": 32, "positions": 64}


def build_qwen3vl_embedder(folder: str, seed: int = 0, sizes: dict | None = None) -> str:
    """Build a random Qwen3-VL embedding model in ``folder`` (ST 6.3 layout), TINY_SIZES unless
    `sizes` (BENCH_SIZES) says otherwise. Returns ``folder``."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    torch.manual_seed(seed)
    size = {**TINY_SIZES, **(sizes or {})}
    tokenizer, ids = build_tokenizer()
    vocab_size = len(tokenizer)
    patch, merge, tpatch = size["patch"], 2, 2
    hidden, heads = size["hidden"], size["heads"]
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=size["layers"],
            num_attention_heads=heads,
            num_key_value_heads=2,
            head_dim=size["head_dim"],
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": size["mrope_section"],
                "mrope_interleaved": True,
            },
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=size["vision_depth"],
            hidden_size=size["vision_hidden"],
            intermediate_size=2 * size["vision_hidden"],
            num_heads=2,
            in_channels=3,
            patch_size=patch,
            spatial_merge_size=merge,
            temporal_patch_size=tpatch,
            out_hidden_size=hidden,
            num_position_embeddings=size["positions"],  # (a learned position grid, interpolated)
            deepstack_visual_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen3VLForConditionalGeneration(config).eval()

    kw = _tiny_image_kwargs(patch, merge, tpatch)
    if "max_tokens" in size:
        kw.update(min_pixels=size["min_tokens"] * (patch * merge) ** 2, max_pixels=size["max_tokens"] * (patch * merge) ** 2)
    image_processor = Qwen2VLImageProcessor(
        **kw, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )  # Qwen3-VL uses Qwen2VLImageProcessor with mean/std 0.5
    video_processor = Qwen3VLVideoProcessor(
        patch_size=patch,
        temporal_patch_size=tpatch,
        merge_size=merge,
        size={"shortest_edge": kw["min_pixels"], "longest_edge": kw["max_pixels"] * 2},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN3_VL_EMBEDDING_CHAT_TEMPLATE,
    )
    with tempfile.TemporaryDirectory(prefix="tiny_qwen3vl_hf_") as hf_dir:
        model.save_pretrained(hf_dir)
        processor.save_pretrained(hf_dir)
        return _finish_with_st(
            hf_dir,
            folder,
            processing_kwargs={"chat_template": {"add_generation_prompt": True}},
        )


VISUAL_PROMPT_PREFIX = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|><|endoftext|>"
)
QUERY_PREFIX = "Query: "


def build_colqwen2(folder: str, seed: int = 0, keep_only_image_tokens: bool = False) -> str:
    """A tiny random ColQwen2 page retriever (ColQwen2ForRetrieval over the tiny Qwen2-VL of
    build_qwen2vl_embedder, 16 values a token; ColQwen2Processor with the real processor's query
    prefix, visual prompt and augmentation token, its tokenizer padding on the left as
    vidore/colqwen2-v1.0-hf's) in `folder`, saved by ST 6.3's MultiVectorEncoder. Returns `folder`.

    keep_only_image_tokens=True sets MultiVectorMask(keep_only_token_ids=[<|image_pad|> id]) like
    colpali-engine's mask_non_image_embeddings=True; the default (False) is what ST builds itself."""
    import transformers
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from transformers import ColQwen2Config, ColQwen2ForRetrieval, ColQwen2Processor, Qwen2VLImageProcessor

    torch.manual_seed(seed)
    tokenizer, ids = build_tokenizer()
    tokenizer.padding_side = "left"
    tokenizer.init_kwargs["padding_side"] = "left"  # persisted in tokenizer_config.json
    vocab_size = len(tokenizer)
    patch, merge, tpatch = 4, 2, 2
    vlm_config = _tiny_qwen2vl_config(ids, vocab_size)
    config = ColQwen2Config(vlm_config=vlm_config, embedding_dim=16)
    config.architectures = ["ColQwen2ForRetrieval"]
    model = ColQwen2ForRetrieval(config).eval()

    image_processor = Qwen2VLImageProcessor(**_tiny_image_kwargs(patch, merge, tpatch))
    processor = ColQwen2Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        visual_prompt_prefix=VISUAL_PROMPT_PREFIX,
        query_prefix=QUERY_PREFIX,
    )

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="tiny_colqwen2_hf_") as hf_dir:
        model.save_pretrained(hf_dir)
        processor.save_pretrained(hf_dir)
        mve = MultiVectorEncoder(
            hf_dir, device="cpu", model_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}
        )
        if keep_only_image_tokens:
            mask = next(m for m in mve if isinstance(m, MultiVectorMask))
            mask.keep_only_token_ids = [tokenizer.convert_tokens_to_ids("<|image_pad|>")]
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        mve.save(folder)
    return folder


# A multimodal yes/no reranker (Qwen3-VL-Reranker's layout) on the tiny Qwen2-VL.
SYSTEM_JUDGE = (
    'Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
    'Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCT = "Given a search query, retrieve relevant candidates that answer the query."

# Qwen3-VL-Reranker layout (as in its vLLM score template), but "structured" (content = list of parts) so
# images/videos inside the query or the document become <|vision_start|><|image_pad|><|vision_end|>.
# A "system" message (ST's prompt / instruction, prepended by ST) replaces the default <Instruct>.
RERANKER_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(instruct='" + DEFAULT_INSTRUCT + "', query='', document='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.instruct = render(message['content']) -%}"
    "{%- elif message['role'] == 'query' -%}{%- set ns.query = ns.query + render(message['content']) -%}"
    "{%- elif message['role'] == 'document' -%}{%- set ns.document = ns.document + render(message['content']) -%}"
    "{%- endif -%}{%- endfor -%}"
    "<|im_start|>system\n" + SYSTEM_JUDGE + "<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: {{ ns.instruct }}<Query>:{{ ns.query }}\n<Document>:{{ ns.document }}<|im_end|>\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen2vl_reranker(folder: str, seed: int = 0) -> str:
    """Build the tiny reranker in `folder` (ST 6.3 CrossEncoder layout). Returns `folder`."""
    import transformers
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules import LogitScore
    from transformers import (
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    torch.manual_seed(seed)
    tokenizer, ids = build_tokenizer()
    # "yes" / "no" must be single tokens: add them to the BPE vocab (plain, non-special tokens).
    for word in ("yes", "no"):
        if len(tokenizer.encode(word, add_special_tokens=False)) != 1:
            tokenizer.add_tokens([word])
    yes_id = tokenizer.convert_tokens_to_ids("yes")
    no_id = tokenizer.convert_tokens_to_ids("no")
    assert tokenizer.encode("yes", add_special_tokens=False) == [yes_id]
    assert tokenizer.encode("no", add_special_tokens=False) == [no_id]
    vocab_size = len(tokenizer)
    patch, merge, tpatch = 4, 2, 2
    config = _tiny_qwen2vl_config(ids, vocab_size)
    model = Qwen2VLForConditionalGeneration(config).eval()
    # Random lm_head rows for yes/no give logit gaps of ~0.1: widen them so scores are well spread.
    with torch.no_grad():
        model.lm_head.weight[yes_id] *= 8
        model.lm_head.weight[no_id] *= 8

    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**_tiny_image_kwargs(patch, merge, tpatch)),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**_tiny_image_kwargs(patch, merge, tpatch)),
        chat_template=RERANKER_CHAT_TEMPLATE,
    )

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="tiny_qwen2vl_rerank_hf_") as hf_dir:
        model.save_pretrained(hf_dir)
        processor.save_pretrained(hf_dir)
        transformer = Transformer(
            hf_dir,
            transformer_task="any-to-any",
            # The template prefills "<|im_start|>assistant\n" only with add_generation_prompt: ST passes
            # chat_template kwargs verbatim to apply_chat_template and sets none by default.
            processing_kwargs={"chat_template": {"add_generation_prompt": True}},
            unpad_inputs=False,
            model_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        )
        logit_score = LogitScore(true_token_id=yes_id, false_token_id=no_id)
        ce = CrossEncoder(
            modules=[transformer, logit_score],
            device="cpu",
            prompts={"web_search": "Given a web search query, retrieve relevant passages that answer the query"},
        )
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        ce.save(folder)
    return folder
