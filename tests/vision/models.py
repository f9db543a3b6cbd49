"""Tiny random checkpoints built from transformers configs (no hub), each saved with its image
processor (explicit arguments) and, for CLIP and SigLIP, a tokenizer trained or written here."""

from __future__ import annotations

import json
from pathlib import Path

TEXTS = (
    "a photo of a red square",
    "a drawing of a blue circle on white",
    "text",
    "ortbatch serves images and texts in the same space, batched on ONNX Runtime",
)


def _clip_tokenizer(directory: Path) -> None:
    """A byte-level CLIP BPE (every byte, alone and word-final, and the merges of a few words),
    written as vocab.json/merges.txt and converted to CLIPTokenizerFast by transformers."""
    from transformers import CLIPTokenizer, CLIPTokenizerFast
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars]
    merges = []
    for word in ("photo", "of", "a", "the", "red", "blue", "square", "circle", "drawing", "text", "images"):
        pieces = [*word[:-1], word[-1] + "</w>"]
        while len(pieces) > 1:
            merges.append(f"{pieces[0]} {pieces[1]}")
            pieces = [pieces[0] + pieces[1], *pieces[2:]]
            if pieces[0] not in vocab:
                vocab.append(pieces[0])
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    tmp = directory / "_slow"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (tmp / "merges.txt").write_text("#version: 0.2\n" + "\n".join(dict.fromkeys(merges)) + "\n")
    slow = CLIPTokenizer(str(tmp / "vocab.json"), str(tmp / "merges.txt"), model_max_length=77)
    slow.save_pretrained(tmp)
    CLIPTokenizerFast.from_pretrained(tmp).save_pretrained(directory)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()


def build_clip(directory: Path, seed: int = 0, legacy_eos: bool = False) -> Path:
    """``legacy_eos``: text_config.eos_token_id 2, as OpenAI's CLIP checkpoints were saved:
    transformers then pools the text at the highest token id (argmax), not at the first EOS."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    _clip_tokenizer(directory)
    vocab = len(CLIPTokenizerFast.from_pretrained(directory))
    tok = CLIPTokenizerFast.from_pretrained(directory)
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config={
            "vocab_size": vocab,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 77,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": 2 if legacy_eos else tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=16,
    )
    CLIPModel(config).eval().save_pretrained(directory)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory


def build_st_clip(directory: Path, seed: int = 1) -> Path:
    """The sentence-transformers CLIP layout (clip-ViT-B-32 style): modules.json with one
    CLIPModel module around a tiny CLIPModel saved in its folder."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers 5.4+ (its old path warns)
        from sentence_transformers.sentence_transformer.modules import CLIPModel as STCLIPModel
    except ImportError:
        from sentence_transformers.models import CLIPModel as STCLIPModel

    base = build_clip(directory.parent / (directory.name + "-base"), seed=seed)
    SentenceTransformer(modules=[STCLIPModel(str(base))]).save(str(directory))
    return directory


def _word_tokenizer(directory: Path, max_length: int) -> None:
    """A WordPiece tokenizer trained here, saved as a fast tokenizer (SigLIP's own is
    sentencepiece; the tower does not care which ids it is given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"])
    tok.train_from_iterator(list(TEXTS) * 4 + ["the quick brown fox jumps over the lazy dog"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=max_length
    )
    fast.save_pretrained(directory)


def build_siglip(directory: Path, seed: int = 2) -> Path:
    import torch
    from transformers import PreTrainedTokenizerFast, SiglipConfig, SiglipImageProcessor, SiglipModel

    directory.mkdir(parents=True, exist_ok=True)
    _word_tokenizer(directory, 16)
    vocab = len(PreTrainedTokenizerFast.from_pretrained(directory))
    torch.manual_seed(seed)
    config = SiglipConfig(
        text_config={
            "vocab_size": vocab,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 16,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
        },
    )
    SiglipModel(config).eval().save_pretrained(directory)
    SiglipImageProcessor(size={"height": 32, "width": 32}, do_convert_rgb=True).save_pretrained(directory)
    return directory


_LABELS = {0: "square", 1: "circle", 2: "noise"}


def build_classifier(kind: str, directory: Path, seed: int = 3) -> Path:
    """A tiny image classifier with 3 labels: vit, deit, beit, convnext, swin, dinov2."""
    import torch
    import transformers as tf

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    labels = {"id2label": _LABELS, "label2id": {v: k for k, v in _LABELS.items()}}
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    if kind == "vit":
        config = tf.ViTConfig(image_size=32, patch_size=8, **small, **labels)
        model = tf.ViTForImageClassification(config)
        proc = tf.ViTImageProcessor(size={"height": 32, "width": 32})
    elif kind == "deit":
        config = tf.DeiTConfig(image_size=32, patch_size=8, **small, **labels)
        model = tf.DeiTForImageClassification(config)
        proc = tf.DeiTImageProcessor(size={"height": 36, "width": 36}, crop_size={"height": 32, "width": 32})
    elif kind == "beit":
        config = tf.BeitConfig(image_size=32, patch_size=8, use_mean_pooling=True, **small, **labels)
        model = tf.BeitForImageClassification(config)
        proc = tf.BeitImageProcessor(size={"height": 36, "width": 36}, crop_size={"height": 32, "width": 32})
    elif kind == "convnext":
        config = tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32, **labels)
        model = tf.ConvNextForImageClassification(config)
        proc = tf.ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=0.875)
    elif kind == "swin":
        config = tf.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, **labels
        )
        model = tf.SwinForImageClassification(config)
        proc = tf.ViTImageProcessor(size={"height": 32, "width": 32})
    elif kind == "dinov2":
        config = tf.Dinov2Config(image_size=32, patch_size=8, **small, **labels)
        model = tf.Dinov2ForImageClassification(config)
        proc = tf.BitImageProcessor(
            size={"shortest_edge": 36},
            crop_size={"height": 32, "width": 32},
            image_mean=[0.485, 0.456, 0.406],
            image_std=[0.229, 0.224, 0.225],
        )
    else:
        raise ValueError(kind)
    model.eval().save_pretrained(directory)
    proc.save_pretrained(directory)
    return directory


def build_dinov2_backbone(directory: Path, seed: int = 4) -> Path:
    """A tiny DINOv2 without a head (image feature extraction)."""
    import torch
    import transformers as tf

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tf.Dinov2Config(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    tf.Dinov2Model(config).eval().save_pretrained(directory)
    tf.BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory
