"""Small BERT models built on the fly with transformers' own classes (random weights, fixed seed,
the bundled tokenizer). Shared by the tests (a head or config option to check against
transformers' forward pass) and the load-test scripts (a model whose forward pass costs almost
nothing, so the CPU side of the pipeline is what gets measured: that is what a GPU engine looks
like from the CPU)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The tiny model stands for a GPU engine, so it gets a GPU's batch shape (the CPU budget of 2048
# tokens is tuned for a real model's forward pass, not for a step that is mostly overhead).
TINY_BATCH_SHAPE = {"max_num_seqs": 256, "max_num_batched_tokens": 16384}


def build_bert(target: str | Path, model_cls=None, *, hidden_size: int = 32, num_hidden_layers: int = 2,
               num_attention_heads: int = 4, intermediate_size: int = 64, max_position_embeddings: int = 128,
               **config_kwargs) -> str:
    """Saves a BERT of `model_cls` (default `BertModel`) with the bundled WordPiece tokenizer in
    `target` and returns its path. Extra keyword arguments go to `BertConfig` (num_labels, ...)."""
    import torch
    from transformers import BertConfig, BertModel

    from pooling_pipeline.core.shared.model_folder.model_path import default_model_path

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                        num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                        max_position_embeddings=max_position_embeddings, **config_kwargs)
    target = Path(target)
    (model_cls or BertModel)(config).eval().save_pretrained(target)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(default_model_path()) / name, target / name)
    return str(target)


def build_tiny_model(target: str | Path | None = None) -> str:
    """As small as a BERT gets: embeddings, layer norm and pooler, no transformer layer, 16 wide.

    Its forward pass costs ~4 us per short request on one CPU thread (one 16-wide layer would
    cost ~10 us, and ~250 us at 256 tokens): close to what a GPU engine costs the CPU, which
    launches the work and waits. The whole engine path still runs: admission, scheduling,
    padding, the transformers forward, pooling, normalization.
    """
    return build_bert(target or tempfile.mkdtemp(prefix="tiny-bert-"), hidden_size=16, num_hidden_layers=0,
                      num_attention_heads=1, intermediate_size=16, max_position_embeddings=512)


def faulty_model_dir(tmp_path: Path, model_path: str, trigger_token_id: int, message: str | None = None,
                     sticky: bool = False) -> Path:
    """A real model whose forward raises RuntimeError when a chosen token id is in the batch
    (`message`: its text; by default "fault token <id> in the batch"). `sticky`: as a CUDA context
    after a device-side assert, every forward after that one raises too.

    The model class lives in a module of the model directory and loads through the normal path
    (transformers' auto_map with trust_remote_code), so no code of the project is patched.
    """
    target = tmp_path / "faulty-model"
    shutil.copytree(model_path, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["auto_map"] = {"AutoModel": "modeling_faulty.FaultyBertModel"}
    cfg["fault_token_id"] = trigger_token_id
    cfg["fault_message"] = message or f"fault token {trigger_token_id} in the batch"
    cfg["fault_sticky"] = sticky
    (target / "config.json").write_text(json.dumps(cfg))
    (target / "modeling_faulty.py").write_text(
        "from transformers import BertModel\n\n\n"
        "class FaultyBertModel(BertModel):\n"
        "    dead = False\n\n"
        "    def forward(self, input_ids=None, **kwargs):\n"
        "        if FaultyBertModel.dead or (input_ids is not None and bool((input_ids == self.config.fault_token_id).any())):\n"
        "            FaultyBertModel.dead = self.config.fault_sticky\n"
        "            raise RuntimeError(self.config.fault_message)\n"
        "        return super().forward(input_ids=input_ids, **kwargs)\n"
    )
    return target


# Qwen2/Qwen3's pre-tokenizer split: GPT-4 style with single digits.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")


def build_tiny_decoder_embedder(target: str | Path | None = None) -> str:
    """A Qwen3-Embedding-shaped model, tiny: a 2-layer Qwen3 backbone, a byte-level BPE tokenizer
    trained on the standard library's docstrings that appends `<|endoftext|>` and pads on the left,
    and sentence-transformers' last-token Pooling + Normalize, saved by ST itself."""
    import corpus
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    target = Path(target or tempfile.mkdtemp(prefix="tiny-qwen3-"))
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus.docstrings(), trainers.BpeTrainer(
        vocab_size=4000, special_tokens=["<|endoftext|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>",
                                                       special_tokens=[("<|endoftext|>", eot)])
    hf_dir = target / "backbone"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            padding_side="left", model_max_length=512).save_pretrained(hf_dir)
    torch.manual_seed(0)
    Qwen3Model(Qwen3Config(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
                           pad_token_id=eot)).save_pretrained(hf_dir)
    model = SentenceTransformer(modules=[Transformer(str(hf_dir)), Pooling(64, pooling_mode="lasttoken"), Normalize()],
                                device="cpu", prompts={"query": "Instruct: Given a question, find the passage\nQuery: "})
    model.save(str(target / "st"))
    shutil.rmtree(hf_dir)
    return str(target / "st")


def build_static_embedding(target: str | Path | None = None, dim: int = 256) -> str:
    """A potion-base-8M-shaped static embedding model (ST's StaticEmbedding + Normalize, saved by ST):
    the bundled WordPiece vocabulary (30,522 tokens, uncased), a random [vocabulary, `dim`] table, no
    truncation (as model2vec saves it)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer

    from pooling_pipeline.core.shared.model_folder.model_path import default_model_path

    target = Path(target or tempfile.mkdtemp(prefix="tiny-static-"))
    tokenizer = Tokenizer.from_file(str(Path(default_model_path()) / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    torch.manual_seed(0)
    static = StaticEmbedding(tokenizer, embedding_weights=torch.randn(tokenizer.get_vocab_size(), dim))
    SentenceTransformer(modules=[static, Normalize()], device="cpu").save(str(target / "st"))
    return str(target / "st")


def build_clip(target: str | Path | None = None, *, vision_hidden: int = 768, vision_layers: int = 12,
               vision_heads: int = 12, vision_intermediate: int = 3072, image_size: int = 224, patch_size: int = 32,
               text_hidden: int = 512, text_layers: int = 12, text_heads: int = 8, text_intermediate: int = 2048,
               projection_dim: int = 512) -> str:
    """A CLIP dual encoder with random weights (fixed seed), saved by sentence-transformers 6 as one
    Transformer module over a CLIPModel + CLIPProcessor folder. The defaults are ViT-B/32's shape, so
    the engine's forward pass costs what the real model's does; the tokenizer is the test zoo's
    byte-level BPE (RoBERTa's specials), cut at CLIP's 77 positions."""
    import sys

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    tests_dir = str(Path(__file__).resolve().parent.parent / "tests")
    if tests_dir not in sys.path:  # the zoo's tokenizers live with the tests
        sys.path.insert(0, tests_dir)
    from model_zoo import roberta_tokenizer

    target = Path(target or tempfile.mkdtemp(prefix="clip-"))
    tok = roberta_tokenizer()
    tok.model_max_length = 77
    config = CLIPConfig(
        text_config={"hidden_size": text_hidden, "num_hidden_layers": text_layers, "num_attention_heads": text_heads,
                     "intermediate_size": text_intermediate, "max_position_embeddings": 77, "vocab_size": len(tok),
                     "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
                     "pad_token_id": tok.pad_token_id},
        vision_config={"hidden_size": vision_hidden, "num_hidden_layers": vision_layers,
                       "num_attention_heads": vision_heads, "intermediate_size": vision_intermediate,
                       "image_size": image_size, "patch_size": patch_size},
        projection_dim=projection_dim)
    torch.manual_seed(0)
    hf_dir = target / "hf"
    CLIPModel(config).eval().save_pretrained(hf_dir)
    CLIPProcessor(image_processor=CLIPImageProcessorPil(), tokenizer=tok).save_pretrained(hf_dir)
    SentenceTransformer(modules=[Transformer(str(hf_dir))], device="cpu").save(str(target / "st"))
    shutil.rmtree(hf_dir)
    return str(target / "st")


def build_clap(target: str | Path | None = None, *, audio_hidden: int = 768, patch_embeds_hidden: int = 96,
               depths: tuple[int, ...] = (2, 2, 6, 2), heads: tuple[int, ...] = (4, 8, 16, 32), text_hidden: int = 768,
               text_layers: int = 12, text_heads: int = 12, text_intermediate: int = 3072,
               projection_dim: int = 512) -> str:
    """A CLAP model with random weights (fixed seed), saved by sentence-transformers 6 as one
    Transformer module over a ClapModel + ClapProcessor folder. The defaults are
    laion/clap-htsat-unfused's shape (an HTS-AT audio tower over 48 kHz, 10 s, 64-mel features;
    a RoBERTa-base text tower; no fusion), so the engine's forward pass costs what the real model's
    does; the tokenizer is the test zoo's byte-level BPE (RoBERTa's specials)."""
    import sys

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor

    tests_dir = str(Path(__file__).resolve().parent.parent / "tests")
    if tests_dir not in sys.path:  # the zoo's tokenizers live with the tests
        sys.path.insert(0, tests_dir)
    from model_zoo import roberta_tokenizer

    target = Path(target or tempfile.mkdtemp(prefix="clap-"))
    tok = roberta_tokenizer()
    config = ClapConfig(
        text_config={"hidden_size": text_hidden, "num_hidden_layers": text_layers, "num_attention_heads": text_heads,
                     "intermediate_size": text_intermediate, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id},
        audio_config={"hidden_size": audio_hidden, "patch_embeds_hidden_size": patch_embeds_hidden,
                      "depths": list(depths), "num_attention_heads": list(heads), "enable_fusion": False},
        projection_dim=projection_dim)
    torch.manual_seed(0)
    hf_dir = target / "hf"
    ClapModel(config).eval().save_pretrained(hf_dir)
    extractor = ClapFeatureExtractor(truncation="rand_trunc", padding="repeatpad")
    ClapProcessor(feature_extractor=extractor, tokenizer=tok).save_pretrained(hf_dir)
    SentenceTransformer(modules=[Transformer(str(hf_dir))], device="cpu").save(str(target / "st"))
    shutil.rmtree(hf_dir)
    return str(target / "st")


def build_colpali(target: str | Path | None = None, *, image_size: int = 448, patch_size: int = 14,
                  vision_hidden: int = 384, vision_layers: int = 6, vision_heads: int = 6,
                  vision_intermediate: int = 1536, text_hidden: int = 512, text_layers: int = 4,
                  text_heads: int = 8, text_intermediate: int = 2048, embedding_dim: int = 128) -> str:
    """A ColPali page retriever with random weights (fixed seed), saved by sentence-transformers 6's
    MultiVectorEncoder. ColPali v1.3's input -- 448 px pages in 14 px patches, 1,024 image tokens a
    page, 128 values a token -- on much smaller towers (a 6-layer SigLIP of width 384, a 4-layer Gemma
    of width 512; the real model's So400m and Gemma-2B take ~30 s a page on 2 CPU cores, a ViT-B and
    a 6-layer Gemma of width 1,024 3 s): a benchmark of the pipeline around the model, not of the
    model. The tokenizer is the test zoo's Gemma-style BPE."""
    import sys

    tests_dir = str(Path(__file__).resolve().parent.parent / "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    from model_zoo import build_colpali as build

    target = Path(target or tempfile.mkdtemp(prefix="colpali-"))
    return build(target, "colpali", image_size=image_size, patch_size=patch_size, embedding_dim=embedding_dim,
                 vision={"hidden_size": vision_hidden, "num_hidden_layers": vision_layers,
                         "num_attention_heads": vision_heads, "intermediate_size": vision_intermediate},
                 text={"hidden_size": text_hidden, "num_hidden_layers": text_layers, "num_attention_heads": text_heads,
                       "num_key_value_heads": text_heads, "head_dim": text_hidden // text_heads,
                       "intermediate_size": text_intermediate})
