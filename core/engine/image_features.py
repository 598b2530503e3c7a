"""A dual encoder's image features (`get_image_features`' vectors) as a module of one input, for
the OpenVINO converter -- with the work the vector does not read left out where that is exact.

CLIP's image vector is the projection of the layer-normed *first* (class) position of the last
encoder layer. That layer's attention still reads every position's keys and values, but its query,
attention output, residual and MLP are needed at the class position only: 49 of a ViT-B/32's 50
positions (~7% of the tower's multiply-adds) are computed and thrown away. `ClassPositionCLIP` runs
the same modules with the same weights in the same order, on that one position in the last layer,
so it is the same arithmetic (the matrix products' blocking aside: float32 rounding, checked
against the full torch tower on every start). It is used only for transformers' own CLIP classes,
matched by exact type; every other tower (SigLIP's attention-pooling head reads all positions,
another CLIP-like class may differ) runs whole."""

from __future__ import annotations

import torch


class ImageFeatures(torch.nn.Module):
    """get_image_features' vectors (pooler_output), the whole tower."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model.get_image_features(pixel_values=pixel_values)
        return out if isinstance(out, torch.Tensor) else out.pooler_output


class ClassPositionCLIP(torch.nn.Module):
    """CLIPModel.get_image_features with the last encoder layer at the class position only."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        vision = self.model.vision_model
        hidden = vision.pre_layrnorm(vision.embeddings(pixel_values))
        *layers, last = vision.encoder.layers
        for layer in layers:
            hidden = layer(hidden, None)
        first = _class_position_of_layer(last, hidden)
        return self.model.visual_projection(vision.post_layernorm(first))


def _class_position_of_layer(layer, hidden: torch.Tensor) -> torch.Tensor:
    """CLIPEncoderLayer.forward's output at position 0 ([n, hidden]): every position's keys and
    values, the class position's query and everything after the attention."""
    attention = layer.self_attn
    n, positions, width = hidden.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    normed = layer.layer_norm1(hidden)
    query = attention.q_proj(normed[:, :1]).view(n, 1, heads, head_dim).transpose(1, 2)
    keys = attention.k_proj(normed).view(n, positions, heads, head_dim).transpose(1, 2)
    values = attention.v_proj(normed).view(n, positions, heads, head_dim).transpose(1, 2)
    weights = torch.softmax(torch.matmul(query, keys.transpose(-1, -2)) * attention.scale, dim=-1, dtype=torch.float32)
    attended = torch.matmul(weights.to(query.dtype), values).transpose(1, 2).reshape(n, width)
    first = hidden[:, 0] + attention.out_proj(attended)
    return first + layer.mlp(layer.layer_norm2(first))


class FromPixels(torch.nn.Module):
    """`tower` on uint8 pixels: (x * scale - mean) / std in float32 first, the image processor's
    rescale and normalize (as the engine does them on a device), inside the converted graph, where
    OpenVINO fuses them into the first layer instead of a pass over every value in numpy."""

    def __init__(self, tower: torch.nn.Module, scale: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.tower = tower
        self.register_buffer("scale", scale.detach().clone())
        self.register_buffer("mean", mean.detach().clone())  # [1, C, 1, 1]
        self.register_buffer("std", std.detach().clone())

    def values(self, pixels: torch.Tensor) -> torch.Tensor:
        """The processor's float values of uint8 pixels (what the engine's torch backend computes)."""
        return (pixels.float() * self.scale - self.mean) / self.std

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.tower(self.values(pixels))


def image_features_module(model) -> tuple[torch.nn.Module, str]:
    """(the module to convert, what it computes: "class position" or "whole tower")."""
    if _is_plain_clip(model):
        return ClassPositionCLIP(model), "class position"
    return ImageFeatures(model), "whole tower"


def _is_plain_clip(model) -> bool:
    """transformers' own CLIPModel whose image tower is built of its own classes, in eval mode (no
    dropout), without a forward hook or an attention implementation of its own."""
    from transformers.models.clip import modeling_clip as clip

    if type(model) is not clip.CLIPModel or model.training:
        return False
    vision = model.vision_model
    if type(vision) is not clip.CLIPVisionModel or type(vision.encoder) is not clip.CLIPEncoder:
        return False
    if getattr(vision.config, "_attn_implementation", None) not in (None, "eager", "sdpa"):
        return False
    layers = list(vision.encoder.layers)
    parts = [vision, vision.embeddings, vision.encoder, *layers,
             *(part for layer in layers for part in (layer.self_attn, layer.mlp))]
    if any(part._forward_hooks or part._forward_pre_hooks for part in parts):
        return False
    return bool(layers) and all(type(layer) is clip.CLIPEncoderLayer and type(layer.self_attn) is clip.CLIPAttention
                                and type(layer.mlp) is clip.CLIPMLP for layer in layers)
