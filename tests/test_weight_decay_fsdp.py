"""Weight-decay groups survive FSDP's flattening (issue 14): 2 gloo processes, real torch FSDP on CPU.

Lightning's FSDPStrategy refuses a CPU accelerator, so the models are wrapped with torch's
``FullyShardedDataParallel(use_orig_params=True)`` directly, as Lightning does on GPUs: every
parameter the optimizer then sees is a flat 1-D shard named ``..._fsdp_wrapped_module...``.
"""

from __future__ import annotations

import multiprocessing
import os
import socket

import torch

from mmssl.optim import clean_name, param_groups

TIMEOUT_S = 120


def _groups(model: torch.nn.Module, shapes) -> list[set[str]]:
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    return [{names[id(p)] for p in g["params"]} for g in param_groups(model, model.no_weight_decay, shapes)]


def _worker(rank: int, port: int, queue) -> None:
    try:
        import torch.distributed as dist
        from open_clip.transformer import ResidualAttentionBlock
        from timm.models.vision_transformer import Block
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from mmssl.models.clip import CLIP
        from mmssl.models.mae import MAE

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.manual_seed(0)
        mae = MAE(image_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=4,
                  decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=4)
        clip = CLIP(os.path.join(os.path.dirname(__file__), "..", "configs", "models", "clip_micro.json"),
                    no_weight_decay=["*bias", "*ln_*.weight", "*positional_embedding"])  # FLIP's rule
        out = {}
        for key, model, parts, block in (("mae", mae, ("encoder", "decoder"), Block),
                                         ("clip", clip.model, ("visual", "transformer"), ResidualAttentionBlock)):
            root = clip if key == "clip" else mae
            before = _groups(root, root._param_ndim)
            for part in parts:  # CLIP's scalar logit_scale stays outside: FSDP 1 refuses 0-d parameters
                wrapped = FSDP(getattr(model, part), use_orig_params=True, device_id=torch.device("cpu"),
                               auto_wrap_policy=ModuleWrapPolicy({block}))
                setattr(model, part, wrapped)
            flat = {p.ndim for n, p in root.named_parameters() if "_fsdp_wrapped_module" in n}
            names = {id(p): clean_name(n) for n, p in root.named_parameters()}
            old_rule = param_groups(root, ("ndim<2",), None)[-1]["params"]  # ndim of the live tensors
            out[key] = dict(before=before, after=_groups(root, root._param_ndim), flat=flat,
                            live_plain={names[id(p)] for p in old_rule})
        out["whole_clip"] = _whole_clip_under_fsdp(rank)
        queue.put((rank, out))
        dist.destroy_process_group()
    except BaseException as exc:  # report, never hang the parent
        queue.put((rank, repr(exc)))


def _whole_clip_under_fsdp(rank: int) -> dict:
    """What Lightning's FSDPStrategy does to a CLIP: configure_model, then wrap the whole model."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from mmssl.models.clip import CLIP

    config = os.path.join(os.path.dirname(__file__), "..", "configs", "models", "clip_micro.json")
    torch.manual_seed(0)
    clip = CLIP(config, loss="siglip")
    reference = {k: v.clone() for k, v in clip.state_dict().items()}
    refused = ""
    try:
        FSDP(CLIP(config, loss="siglip"), use_orig_params=True, device_id=torch.device("cpu"))
    except ValueError as exc:  # open_clip's 0-d logit_scale, as it comes
        refused = str(exc)
    clip.scalars_as_vectors()
    wrapped = FSDP(clip, use_orig_params=True, device_id=torch.device("cpu"))
    torch.manual_seed(1 + rank)
    images, tokens = torch.randn(4, 3, 32, 32), torch.randint(1, 100, (4, 8))
    loss = clip.contrastive_loss(wrapped(images, tokens))
    loss.backward()
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        saved = {k.replace("_fsdp_wrapped_module.", ""): v.clone() for k, v in wrapped.state_dict().items()}
    plain = CLIP(config, loss="siglip")
    plain.load_state_dict(saved, strict=True)  # FSDP-saved weights into an unwrapped model
    return dict(refused=refused, loss=float(loss), finite=bool(torch.isfinite(loss)),
                shapes={k: tuple(saved[k].shape) for k in ("model.logit_scale", "model.logit_bias")},
                same=all(torch.equal(saved[k], reference[k]) for k in reference),
                reloaded=all(torch.equal(plain.state_dict()[k], reference[k]) for k in reference))


def test_decay_groups_are_the_same_after_fsdp_flattening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Spawned, not forked: a fork copies the suite's process mid-run, with whatever threads earlier
    # tests left in it (a lock one of them held stays held in the child: a hang at the 120 s
    # timeout, twice in CI); a spawned worker starts clean, at ~5 s of imports.
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=TIMEOUT_S) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, out in results.items():
        assert isinstance(out, dict), f"rank {rank}: {out}"
        for key, o in ((k, v) for k, v in out.items() if k != "whole_clip"):
            assert o["flat"] == {1}, f"{key}: FSDP did not flatten the parameters"
            decay, no_decay = o["before"]
            assert o["after"] == o["before"], f"rank {rank} {key}: groups changed under FSDP"
        # What a live-ndim rule does with the shards: the wrapped weight matrices escape decay.
        assert {"encoder.blocks.0.attn.qkv.weight", "decoder.embed.weight"} <= out["mae"]["live_plain"]
        assert {"model.visual.conv1.weight", "model.transformer.resblocks.0.mlp.c_fc.weight"} <= out["clip"][
            "live_plain"
        ]
        whole = out.pop("whole_clip")
        assert "scalar parameters" in whole["refused"]  # why CLIP.configure_model reshapes them
        assert whole["finite"] and whole["shapes"] == {"model.logit_scale": (), "model.logit_bias": ()}
        assert whole["same"] and whole["reloaded"]  # open_clip-shaped checkpoints, loadable unwrapped
        mae_decay, mae_plain = out["mae"]["before"]
        assert {"encoder.cls_token", "decoder.mask_token", "encoder.blocks.0.attn.qkv.weight"} <= mae_decay
        assert {"encoder.blocks.0.norm1.weight", "decoder.pred.bias"} <= mae_plain
        clip_decay, clip_plain = out["clip"]["before"]
        assert {"model.visual.class_embedding", "model.logit_scale", "model.token_embedding.weight"} <= clip_decay
        assert {
            "model.visual.positional_embedding",
            "model.positional_embedding",
            "model.ln_final.weight",
        } <= clip_plain
