"""mmssl SigLIP checkpoints -> a Hugging Face ``transformers`` ``SiglipModel`` folder.

The SigLIP recipe's towers (open_clip ``ViT-B-16-SigLIP``, configs/models/siglip_vit_b16.json) are
a timm ``VisionTransformer`` without a class token, pooled by a one-query attention head (timm
``AttentionPoolLatent``, "MAP"), and open_clip's bidirectional ``TextTransformer`` pooled at the
last position with a biased projection: what ``SiglipVisionModel`` / ``SiglipTextModel`` are
(transformers' own SigLIP conversion starts from big_vision; none starts from open_clip, hence
this file). The export renames tensors (fused ``qkv`` split into ``q/k/v_proj``, the pool's
``q`` + ``kv`` fused into ``nn.MultiheadAttention``'s ``in_proj``) and writes the configs.

Written: ``config.json`` + ``model.safetensors`` (``SiglipModel.save_pretrained``), a
``SiglipImageProcessor`` (the model's size, mean and std; it resizes to the square size, no crop,
as SigLIP's preprocessing) and the tokenizer: the local Hugging Face tokenizer folder of
``model.tokenizer`` (the recipe's SentencePiece model) saved again, or open_clip's BPE vocabulary
as ``CLIPTokenizer`` files. Either tokenizer pads with the id open_clip pads with and returns no
attention mask: the text tower attends to its padding, as in training, so the padding is input.

Towers ``SiglipModel`` cannot hold are refused naming the part (class or register tokens, other
pooling, layer scale, QK-norm, an image projection, a causal text tower, ...).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from open_clip.transformer import QuickGELU, TextTransformer
from torch import nn

from mmssl.checkpoints.layouts import StateDict
from mmssl.export.hf import NotRepresentable, check_blocks, norm_tensors, write_tokenizer_files


def is_siglip_shaped(model: nn.Module) -> bool:
    """Whether ``model`` has a timm image tower and a bidirectional open_clip text tower (the
    SigLIP recipe's shape), so ``--format hf`` means ``SiglipModel`` rather than ``CLIPModel``."""
    text = getattr(model, "text", None)
    trunk = getattr(model.visual, "trunk", None)
    return (isinstance(text, TextTransformer) and getattr(text, "attn_mask", 0) is None
            and trunk is not None and type(trunk).__name__ == "VisionTransformer")


def _act_name(act: nn.Module, where: str) -> str:
    if isinstance(act, QuickGELU):
        return "quick_gelu"
    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_pytorch_tanh"}[act.approximate]
    raise NotRepresentable(f"{where}: activation {act!r} (SiglipModel has gelu, gelu_pytorch_tanh, quick_gelu)")


def _identity(module: Optional[nn.Module]) -> bool:
    """No module, ``nn.Identity`` or an empty ``nn.Sequential`` (open_clip's ``TimmModel.head``
    with ``timm_proj: none``)."""
    return module is None or isinstance(module, nn.Identity) or (isinstance(module, nn.Sequential) and not len(module))


def _check_image_tower(visual: nn.Module) -> tuple[str, float]:
    """The image tower's activation and LayerNorm eps; refuse what ``SiglipVisionModel`` lacks."""
    trunk = visual.trunk
    if trunk.num_prefix_tokens or getattr(trunk, "cls_token", None) is not None:
        raise NotRepresentable(f"image tower {type(trunk).__name__} has {trunk.num_prefix_tokens} class/register "
                               "tokens: SiglipVisionModel has none")
    pool = getattr(trunk, "attn_pool", None)
    if trunk.global_pool != "map" or pool is None or getattr(pool, "latent_len", 1) != 1 or pool.pos_embed is not None:
        raise NotRepresentable(f"image tower pooling {trunk.global_pool!r}: SiglipVisionModel pools with one "
                               "attention query (timm global_pool='map')")
    if not all(_identity(m) for m in (pool.q_norm, pool.k_norm, trunk.norm_pre, trunk.fc_norm, trunk.head,
                                      trunk.patch_embed.norm, getattr(visual, "head", None))):
        raise NotRepresentable("image tower with a pre-norm, fc-norm, QK-norm in the pool, a classifier head or an "
                               "image projection (timm_proj must be 'none'): SiglipVisionModel has none of them")
    if trunk.patch_embed.proj.bias is None or getattr(trunk, "dynamic_img_size", False):
        raise NotRepresentable("image tower patch embedding without a bias, or with dynamic image size")
    acts, eps = {_act_name(pool.mlp.act, "image tower pool")}, {pool.norm.eps, trunk.norm.eps}
    for i, block in enumerate(trunk.blocks):
        where = f"image tower block {i}"
        if type(block).__name__ != "Block" or not all(_identity(m) for m in (
                block.ls1, block.ls2, block.attn.q_norm, block.attn.k_norm, getattr(block.attn, "norm", None),
                getattr(block.mlp, "norm", None))):
            raise NotRepresentable(f"{where}: {type(block).__name__} with layer scale or extra norms, which "
                                   "SiglipEncoderLayer lacks")
        if block.attn.qkv.bias is None:
            raise NotRepresentable(f"{where}: attention without a q/k/v bias")
        acts.add(_act_name(block.mlp.act, where))
        eps |= {block.norm1.eps, block.norm2.eps}
    if len(acts) != 1 or len(eps) != 1:
        raise NotRepresentable(f"image tower: mixed activations {acts} or LayerNorm eps {eps}")
    return acts.pop(), eps.pop()


def _check_text_tower(text: nn.Module) -> tuple[str, float]:
    if text.pool_type != "last" or getattr(text, "cls_emb", None) is not None:
        raise NotRepresentable(f"text tower pooled by {text.pool_type!r} or with a class token: SiglipTextModel pools "
                               "the last position")
    if not isinstance(text.text_projection, nn.Linear):
        raise NotRepresentable("text projection that is not a linear layer (SiglipTextModel's head is one)")
    _, eps = check_blocks(text.transformer.resblocks, "text tower")
    acts = {_act_name(block.mlp.gelu, f"text tower block {i}") for i, block in enumerate(text.transformer.resblocks)}
    if text.ln_final.eps != eps or len(acts) != 1:
        raise NotRepresentable(f"text tower: final LayerNorm eps {text.ln_final.eps} vs the blocks' {eps}, or mixed "
                               f"activations {acts}")
    return acts.pop(), eps


def check_siglip_representable(model: nn.Module) -> None:
    """Raise :class:`NotRepresentable` naming the first part ``SiglipModel`` cannot hold."""
    image_act, image_eps = _check_image_tower(model.visual)
    _check_text_tower(model.text)
    width, projection = model.visual.trunk.embed_dim, model.text.text_projection.out_features
    if width != projection:
        raise NotRepresentable(f"image tower width {width} != text projection {projection}: SiglipModel's image "
                               "embedding is the pooled tower output, without a projection")


def _blocks(blocks: nn.Module, prefix: str, timm: bool) -> StateDict:
    """Encoder layers under ``{prefix}.encoder.layers.i`` (timm ``Block`` or open_clip's)."""
    out: StateDict = {}
    names = (("norm1", "layer_norm1"), ("norm2", "layer_norm2"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2"),
             ("attn.proj", "self_attn.out_proj")) if timm else (
        ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2"),
        ("attn.out_proj", "self_attn.out_proj"))
    for i, block in enumerate(blocks):
        p = f"{prefix}.encoder.layers.{i}."
        weight, bias = (block.attn.qkv.weight, block.attn.qkv.bias) if timm else (
            block.attn.in_proj_weight, block.attn.in_proj_bias)
        for name, w, b in zip("qkv", weight.chunk(3), bias.chunk(3)):  # (3D, D) -> 3 x (D, D), q, k, v order
            out[f"{p}self_attn.{name}_proj.weight"], out[f"{p}self_attn.{name}_proj.bias"] = w, b
        for ours, theirs in names:
            module = block.get_submodule(ours)
            out[p + theirs + ".weight"], out[p + theirs + ".bias"] = module.weight, module.bias
    return out


def siglip_state_dict(model: nn.Module) -> StateDict:
    """open_clip ``CustomTextCLIP`` (timm image tower) tensors under ``SiglipModel``'s names."""
    trunk, text = model.visual.trunk, model.text
    pool, head = trunk.attn_pool, "vision_model.head."
    projection = text.text_projection
    out: StateDict = {
        "logit_scale": model.logit_scale.reshape(1), "logit_bias": model.logit_bias.reshape(1),
        "vision_model.embeddings.patch_embedding.weight": trunk.patch_embed.proj.weight,
        "vision_model.embeddings.patch_embedding.bias": trunk.patch_embed.proj.bias,
        "vision_model.embeddings.position_embedding.weight": trunk.pos_embed[0],  # (1, N, D) -> (N, D)
        **_blocks(trunk.blocks, "vision_model", timm=True),
        **norm_tensors(trunk.norm, "vision_model.post_layernorm"),
        head + "probe": pool.latent,  # (1, 1, D)
        # timm's pool: q(latent), kv(x) -> k, v; nn.MultiheadAttention fuses them in q, k, v order.
        head + "attention.in_proj_weight": torch.cat([pool.q.weight, pool.kv.weight]),  # (3D, D)
        head + "attention.in_proj_bias": torch.cat([pool.q.bias, pool.kv.bias]),
        head + "attention.out_proj.weight": pool.proj.weight, head + "attention.out_proj.bias": pool.proj.bias,
        **norm_tensors(pool.norm, head + "layernorm"),
        head + "mlp.fc1.weight": pool.mlp.fc1.weight, head + "mlp.fc1.bias": pool.mlp.fc1.bias,
        head + "mlp.fc2.weight": pool.mlp.fc2.weight, head + "mlp.fc2.bias": pool.mlp.fc2.bias,
        "text_model.embeddings.token_embedding.weight": text.token_embedding.weight,
        "text_model.embeddings.position_embedding.weight": text.positional_embedding,
        **_blocks(text.transformer.resblocks, "text_model", timm=False),
        **norm_tensors(text.ln_final, "text_model.final_layer_norm"),
        "text_model.head.weight": projection.weight,
        "text_model.head.bias": projection.bias if projection.bias is not None else projection.weight.new_zeros(
            projection.out_features),  # SiglipTextModel's head always has a bias: 0 is the same map
    }
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def siglip_config(model: nn.Module, pad_token_id: int, eos_token_id: Optional[int]) -> dict[str, Any]:
    """``SiglipConfig`` keyword arguments describing ``model`` (checked first)."""
    check_siglip_representable(model)
    trunk, text = model.visual.trunk, model.text
    v_act, v_eps = _check_image_tower(model.visual)
    t_act, t_eps = _check_text_tower(text)
    t_block = text.transformer.resblocks[0]
    grid = trunk.patch_embed.grid_size
    return {
        "vision_config": {
            "hidden_size": trunk.embed_dim,
            "intermediate_size": trunk.blocks[0].mlp.fc1.out_features,
            "num_hidden_layers": len(trunk.blocks),
            "num_attention_heads": trunk.blocks[0].attn.num_heads,
            "image_size": int(grid[0] * trunk.patch_embed.patch_size[0]),
            "patch_size": trunk.patch_embed.patch_size[0],
            "num_channels": 3,
            "hidden_act": v_act,
            "layer_norm_eps": v_eps,
            "vision_use_head": True,
        },
        "text_config": {
            "vocab_size": text.token_embedding.num_embeddings,
            "hidden_size": text.token_embedding.embedding_dim,
            "intermediate_size": t_block.mlp.c_fc.out_features,
            "num_hidden_layers": len(text.transformer.resblocks),
            "num_attention_heads": t_block.attn.num_heads,
            "max_position_embeddings": text.positional_embedding.shape[0],
            "hidden_act": t_act,
            "layer_norm_eps": t_eps,
            "projection_size": text.text_projection.out_features,
            "pad_token_id": pad_token_id,
            "eos_token_id": eos_token_id,
            "bos_token_id": None,
        },
    }


def _tokenizer(tokenizer_dir: Optional[str], folder: str, context_length: int) -> Any:
    """The tokenizer to save: the model's local HF tokenizer, or open_clip's BPE as CLIPTokenizer
    padding with id 0 (open_clip pads with 0, "!" in its vocabulary). No attention mask: the
    text tower attends to its padding."""
    from transformers import AutoTokenizer, CLIPTokenizer

    # Init arguments, so that save_pretrained writes them into tokenizer_config.json.
    kwargs = {"model_input_names": ["input_ids"], "model_max_length": context_length}
    if tokenizer_dir is not None:
        return AutoTokenizer.from_pretrained(tokenizer_dir, **kwargs)
    write_tokenizer_files(folder)
    return CLIPTokenizer.from_pretrained(folder, pad_token="!", **kwargs)


def write_siglip(module: nn.Module, output: str) -> StateDict:
    """Write an mmssl SigLIP ``CLIP`` as a transformers ``SiglipModel`` folder with its processor.

    Args:
        module: the ``CLIP`` LightningModule (timm image tower, bidirectional text), weights loaded.
        output: folder to write (created).

    Returns:
        The saved state dict (transformers' names).

    Raises:
        NotRepresentable: a part ``SiglipModel`` cannot hold (the message says which).
    """
    model = module.model
    check_siglip_representable(model)
    if getattr(model, "logit_bias", None) is None:
        raise NotRepresentable("no logit_bias: SiglipModel scores with one (train with model.loss: siglip)")
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor

    os.makedirs(output, exist_ok=True)
    context = model.text.positional_embedding.shape[0]
    # The constructor's ``tokenizer`` (a local HF tokenizer folder, or None), as the model recorded it.
    tokenizer = _tokenizer(module.hparams.get("tokenizer"), output, context)
    config = siglip_config(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    hf_model = SiglipModel(SiglipConfig(**config)).eval()
    state = siglip_state_dict(model)
    hf_model.load_state_dict(state, strict=True)  # every tensor has its place, and nothing is left
    hf_model.save_pretrained(output, safe_serialization=True)
    size = config["vision_config"]["image_size"]
    image_processor = SiglipImageProcessor(
        do_resize=True, size={"height": size, "width": size}, resample=3, do_rescale=True, do_normalize=True,
        image_mean=list(module.image_mean), image_std=list(module.image_std), do_convert_rgb=True)
    SiglipProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(output)
    image_processor.save_pretrained(output)  # preprocessor_config.json, read by every version
    return state
