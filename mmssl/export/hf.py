"""mmssl CLIP checkpoints -> a Hugging Face ``transformers`` ``CLIPModel`` folder.

open_clip's ViT image tower and text transformer are the OpenAI CLIP architecture that
``transformers.CLIPModel`` implements, so the export is a renaming of tensors (the attention's
fused ``in_proj`` split into ``q/k/v_proj``, projections transposed) plus configs. transformers
has no open_clip converter (its issue 28072; open_clip issues 591, 766), hence this file.

Written: ``config.json`` + ``model.safetensors`` (``CLIPModel.save_pretrained``), the tokenizer
(``vocab.json`` / ``merges.txt`` rebuilt from open_clip's BPE vocabulary, special tokens named as
OpenAI's HF release names them) and ``preprocessor_config.json`` (the model's image size, mean and
std, bicubic resize and centre crop as open_clip's eval transform). Loaded with
``CLIPModel.from_pretrained(DIR)`` and ``CLIPProcessor.from_pretrained(DIR)``.

Towers transformers cannot represent are refused with the reason: timm or HF image/text towers,
attention pooling, layer scale, QK-norm or scaled-cosine attention, a text tower without the causal
mask or with a class token, non-BPE tokenizers. A model with a timm image tower and a
bidirectional text tower (the SigLIP recipe's ``ViT-B-16-SigLIP``) is written as a ``SiglipModel``
instead (:mod:`mmssl.export.hf_siglip`). A SigLIP-trained model with CLIP's towers exports as a
``CLIPModel`` whose ``config.logit_bias`` holds the learned bias: sigmoid scores are
``torch.sigmoid(out.logits_per_image + model.config.logit_bias)``.

``transformers`` is the ``hf`` extra (``pip install -e .[hf]``), imported only here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from open_clip.tokenizer import SimpleTokenizer
from open_clip.transformer import QuickGELU, ResidualAttentionBlock, TextTransformer, VisionTransformer
from torch import nn

from mmssl.checkpoints.layouts import StateDict

# open_clip's SimpleTokenizer names its specials <start_of_text>/<end_of_text>; OpenAI's HF
# release (openai/clip-vit-base-patch32) <|startoftext|>/<|endoftext|>, same ids 49406/49407.
SPECIAL_TOKENS = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}


class NotRepresentable(ValueError):
    """The model has parts ``transformers.CLIPModel`` has no place for."""


def _text_tower(model: nn.Module) -> nn.Module:
    """The module holding ``token_embedding`` .. ``text_projection`` (the CLIP itself, or ``.text``)."""
    text = getattr(model, "text", model)
    if text is not model and not isinstance(text, TextTransformer):
        raise NotRepresentable(f"the text tower is a {type(text).__name__} (e.g. an HF text model), not open_clip's "
                               "TextTransformer; transformers' CLIPTextModel cannot hold it")
    return text


def _activation(block: ResidualAttentionBlock, where: str) -> str:
    act = block.mlp.gelu
    if isinstance(act, QuickGELU):
        return "quick_gelu"
    if isinstance(act, nn.GELU) and act.approximate == "none":
        return "gelu"
    raise NotRepresentable(f"{where}: activation {act!r} (CLIPModel has gelu and quick_gelu)")


def check_blocks(blocks: nn.ModuleList, where: str) -> tuple[str, float]:
    """The tower's activation and LayerNorm eps; refuse blocks CLIPEncoderLayer cannot be
    (SigLIP's text tower has the same blocks, so :mod:`mmssl.export.hf_siglip` asks this too).

    Args:
        blocks: open_clip ``ResidualAttentionBlock`` s of one tower.
        where: the tower, for the message.

    Returns:
        ``(activation name, eps)`` shared by every block.

    Raises:
        NotRepresentable: a block transformers' encoder layer cannot be.
    """
    acts, eps = set(), set()
    for i, block in enumerate(blocks):
        name = f"{where} block {i}"
        if not isinstance(block, ResidualAttentionBlock) or not isinstance(block.attn, nn.MultiheadAttention):
            raise NotRepresentable(f"{name}: {type(block).__name__}/{type(getattr(block, 'attn', None)).__name__} "
                                   "(open_clip's custom block: QK-norm, scaled-cosine attention, head scaling or "
                                   "extra norms) is not CLIP's attention block")
        if block.attn.in_proj_weight is None or block.attn.in_proj_bias is None:
            raise NotRepresentable(f"{name}: attention without a fused biased q/k/v projection")
        if not (isinstance(block.ls_1, nn.Identity) and isinstance(block.ls_2, nn.Identity)):
            raise NotRepresentable(f"{name}: layer scale (ls_init_value), which CLIPModel lacks")
        mlp = [n for n, _ in block.mlp.named_children()]
        if not isinstance(getattr(block, "ln_attn", nn.Identity()), nn.Identity) or mlp != ["c_fc", "gelu", "c_proj"]:
            raise NotRepresentable(f"{name}: extra norms (scale_attn / scale_fc), which CLIPModel lacks")
        acts.add(_activation(block, name))
        eps |= {block.ln_1.eps, block.ln_2.eps}
    if len(acts) != 1 or len(eps) != 1:
        raise NotRepresentable(f"{where}: mixed activations {acts} or LayerNorm eps {eps} across blocks")
    return acts.pop(), eps.pop()


def check_representable(model: nn.Module) -> None:
    """Raise :class:`NotRepresentable` naming the first part ``CLIPModel`` cannot hold."""
    visual = model.visual
    if not isinstance(visual, VisionTransformer):
        raise NotRepresentable(
            f"the image tower is a {type(visual).__name__} (a timm or ResNet tower), not open_clip's "
            "VisionTransformer; export it with --format open_clip_hf (or --format open_clip) instead")
    if visual.attn_pool is not None or visual.pool_type != "tok":
        raise NotRepresentable(
            f"image tower pooling {visual.pool_type!r}/attentional pool: CLIPModel pools the class token"
        )
    if isinstance(visual.ln_pre, nn.Identity) or visual.conv1.bias is not None:
        raise NotRepresentable(
            "image tower without ln_pre or with a patch-embedding bias (CLIPModel has a pre-norm, no bias)"
        )
    size = visual.image_size if isinstance(visual.image_size, (tuple, list)) else (visual.image_size,) * 2
    if size[0] != size[1] or visual.proj is None or not isinstance(visual.proj, nn.Parameter):
        raise NotRepresentable(f"non-square images {size} or an image projection that is not a plain matrix")
    check_blocks(visual.transformer.resblocks, "image tower")
    text = _text_tower(model)
    pool = getattr(text, "text_pool_type", getattr(text, "pool_type", None))
    if (
        getattr(text, "attn_mask", None) is None
        or pool not in ("argmax", "eos")
        or getattr(text, "cls_emb", None) is not None
    ):
        raise NotRepresentable(f"text tower without the causal mask, with a class token or pooled by {pool!r}: "
                               "CLIPTextModel is causal and pools the end-of-text token")
    projection = text.text_projection
    if isinstance(projection, nn.Linear) and projection.bias is not None:
        raise NotRepresentable("text projection with a bias (CLIPModel's has none)")
    check_blocks(text.transformer.resblocks, "text tower")
    tokenizer_vocab = len(SimpleTokenizer().encoder)
    if text.token_embedding.num_embeddings != tokenizer_vocab:
        raise NotRepresentable(f"text vocabulary of {text.token_embedding.num_embeddings} tokens: the tokenizer files "
                               f"are open_clip's BPE vocabulary of {tokenizer_vocab}")


def _blocks(blocks: nn.ModuleList, prefix: str) -> StateDict:
    out: StateDict = {}
    for i, block in enumerate(blocks):
        p = f"{prefix}.encoder.layers.{i}."
        q, k, v = block.attn.in_proj_weight.chunk(3)  # (3D, D) -> 3 x (D, D), in q, k, v order
        qb, kb, vb = block.attn.in_proj_bias.chunk(3)
        out.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.q_proj.bias": qb,
            p + "self_attn.k_proj.weight": k, p + "self_attn.k_proj.bias": kb,
            p + "self_attn.v_proj.weight": v, p + "self_attn.v_proj.bias": vb,
            p + "self_attn.out_proj.weight": block.attn.out_proj.weight,
            p + "self_attn.out_proj.bias": block.attn.out_proj.bias,
        })
        for ours, theirs in (
            ("ln_1", "layer_norm1"),
            ("ln_2", "layer_norm2"),
            ("mlp.c_fc", "mlp.fc1"),
            ("mlp.c_proj", "mlp.fc2"),
        ):
            module = block.get_submodule(ours)
            out[p + theirs + ".weight"], out[p + theirs + ".bias"] = module.weight, module.bias
    return out


def norm_tensors(module: nn.LayerNorm, key: str) -> StateDict:
    """A LayerNorm's weight and bias under transformers' ``key.weight`` / ``key.bias``."""
    return {key + ".weight": module.weight, key + ".bias": module.bias}


def hf_state_dict(model: nn.Module) -> StateDict:
    """open_clip ``CLIP`` / ``CustomTextCLIP`` tensors under ``CLIPModel``'s names."""
    visual, text = model.visual, _text_tower(model)
    projection = text.text_projection
    projection = projection.weight if isinstance(projection, nn.Linear) else projection.T  # -> (E, D)
    out: StateDict = {
        "logit_scale": model.logit_scale.reshape(()),
        "vision_model.embeddings.class_embedding": visual.class_embedding,
        "vision_model.embeddings.patch_embedding.weight": visual.conv1.weight,
        "vision_model.embeddings.position_embedding.weight": visual.positional_embedding,
        **norm_tensors(visual.ln_pre, "vision_model.pre_layrnorm"),  # sic: transformers' spelling
        **_blocks(visual.transformer.resblocks, "vision_model"),
        **norm_tensors(visual.ln_post, "vision_model.post_layernorm"),
        "visual_projection.weight": visual.proj.T,  # open_clip: x @ proj, (D, E); Linear: (E, D)
        "text_model.embeddings.token_embedding.weight": text.token_embedding.weight,
        "text_model.embeddings.position_embedding.weight": text.positional_embedding,
        **_blocks(text.transformer.resblocks, "text_model"),
        **norm_tensors(text.ln_final, "text_model.final_layer_norm"),
        "text_projection.weight": projection,
    }
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def hf_config(model: nn.Module) -> dict[str, Any]:
    """``CLIPConfig`` keyword arguments describing ``model`` (checked by :func:`check_representable`)."""
    visual, text = model.visual, _text_tower(model)
    v_act, v_eps = check_blocks(visual.transformer.resblocks, "image tower")
    t_act, t_eps = check_blocks(text.transformer.resblocks, "text tower")
    v_block, t_block = visual.transformer.resblocks[0], text.transformer.resblocks[0]
    size = visual.image_size if isinstance(visual.image_size, (tuple, list)) else (visual.image_size,)
    embed_dim = visual.proj.shape[1]
    config = {
        "projection_dim": embed_dim,
        "logit_scale_init_value": float(model.logit_scale.detach().reshape(-1)[0]),
        "vision_config": {
            "hidden_size": visual.conv1.out_channels,
            "intermediate_size": v_block.mlp.c_fc.out_features,
            "num_hidden_layers": len(visual.transformer.resblocks),
            "num_attention_heads": v_block.attn.num_heads,
            "image_size": int(size[0]),
            "patch_size": visual.conv1.kernel_size[0],
            "num_channels": 3,
            "hidden_act": v_act,
            "layer_norm_eps": v_eps,
            "projection_dim": embed_dim,
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
            "projection_dim": embed_dim,
            # Pool at the first end-of-text token (transformers >= 4.31 with eos_token_id != 2),
            # which is open_clip's argmax pooling: <end_of_text> has the highest id.
            "bos_token_id": 49406,
            "eos_token_id": 49407,
            "pad_token_id": 49407,
        },
    }
    if getattr(model, "logit_bias", None) is not None:
        config["logit_bias"] = float(model.logit_bias.detach().reshape(-1)[0])  # SigLIP; see the module docstring
    return config


def write_tokenizer_files(folder: str) -> None:
    """``vocab.json`` and ``merges.txt`` of open_clip's BPE vocabulary, in OpenAI's HF format."""
    bpe = SimpleTokenizer()
    vocab = {SPECIAL_TOKENS.get(token, token): i for token, i in bpe.encoder.items()}
    merges = sorted(bpe.bpe_ranks, key=bpe.bpe_ranks.__getitem__)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        # CLIPTokenizer skips the first line of merges.txt (the "#version" header).
        f.write("#version: 0.2\n" + "\n".join(" ".join(pair) for pair in merges) + "\n")


def write_hf(module: nn.Module, output: str) -> StateDict:
    """Write an mmssl ``CLIP`` as a transformers ``CLIPModel`` folder with tokenizer and processor
    (``--format hf`` writes a ``SiglipModel`` one instead for the SigLIP recipe's tower shape:
    :mod:`mmssl.export.hf_siglip`, chosen by :mod:`mmssl.export.checkpoint`).

    Args:
        module: the ``CLIP`` LightningModule, weights loaded.
        output: folder to write (created).

    Returns:
        The saved state dict (transformers' names).

    Raises:
        NotRepresentable: a tower ``CLIPModel`` cannot hold (the message says which).
        ImportError: transformers is not installed (``pip install -e .[hf]``).
    """
    model = module.model
    check_representable(model)
    try:
        from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    except ImportError as err:
        raise ImportError("--format hf needs transformers: pip install -e '.[hf]'") from err
    config_kwargs = hf_config(model)
    hf_model = CLIPModel(CLIPConfig(**config_kwargs)).eval()
    state = hf_state_dict(model)
    hf_model.load_state_dict(state, strict=True)  # every tensor has its place, and nothing is left
    os.makedirs(output, exist_ok=True)
    hf_model.save_pretrained(output, safe_serialization=True)
    write_tokenizer_files(output)  # vocab.json + merges.txt, what any transformers version reads
    tokenizer = CLIPTokenizer.from_pretrained(output)
    tokenizer.model_max_length = config_kwargs["text_config"]["max_position_embeddings"]
    size = config_kwargs["vision_config"]["image_size"]
    # open_clip's eval transform: bicubic resize of the short side, centre crop, mean/std.
    image_processor = CLIPImageProcessor(
        do_resize=True, size={"shortest_edge": size}, resample=3, do_center_crop=True,
        crop_size={"height": size, "width": size}, do_rescale=True, do_normalize=True,
        image_mean=list(module.image_mean), image_std=list(module.image_std), do_convert_rgb=True,
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(output)
    # transformers 5 nests the image settings in processor_config.json; preprocessor_config.json
    # is the file CLIPImageProcessor.from_pretrained reads in every version.
    image_processor.save_pretrained(output)
    return state
