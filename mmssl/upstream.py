"""The private internals of upstream libraries that mmssl relies on, each behind one named function.

Where torch, Lightning, timm or open_clip offer a public API, mmssl uses it; this module holds
what is left, so an upgrade that changes one of these internals breaks here, in
``tests/test_upstream.py`` (each function has a test of the assumption it makes, whose failure
names the library, the internal and what changed), and not in a user's run. Each docstring says
what the function assumes and why no public API does the job.

Bottom floor (below the ground floor): imports torch and Lightning only (open_clip's public
``text_global_pool`` inside the one function that needs it); every mmssl module may import it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Lightning ---------------------------------------------------------------------------------------


def attached_trainer(module: pl.LightningModule) -> Optional[pl.Trainer]:
    """The trainer ``module`` is attached to, or ``None`` for a module driven by hand.

    Assumes ``LightningModule._trainer``, which the public ``trainer`` setter writes. No public
    getter answers "is there one": the ``trainer`` property raises when there is none (and
    returns a Fabric shim under Fabric, where this gives ``None``).

    Args:
        module: any LightningModule.

    Returns:
        The trainer, or ``None``.
    """
    return module._trainer


def lightning_cli_class_path(hparams: Mapping[str, Any]) -> Optional[str]:
    """The model class a LightningCLI run recorded in its checkpoint's ``hyper_parameters``.

    Assumes LightningCLI's instantiator saves a subclass-mode model's ``class_path`` under the key
    ``_class_path`` of ``hparams`` (Lightning ``cli.py``, ``_InstantiatorFn``, "to clarify its
    internal use"), which ``LightningCLI`` itself reads back for ``--ckpt_path``. No public API
    names a checkpoint's class; the run's ``config.yaml`` is the public record, read when this is
    ``None``.

    Args:
        hparams: a checkpoint's ``hyper_parameters``.

    Returns:
        The dotted class path, or ``None``.
    """
    return hparams.get("_class_path")


def lightning_logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's ``on_step`` metrics to the loggers.

    Assumes ``trainer._logger_connector.should_update_logs``: True every ``log_every_n_steps``
    optimizer-stepping batches (and when the run stops), the rule Lightning's ``self.log`` applies.
    No public API: ``trainer.log_every_n_steps`` and ``global_step`` give the rule only with
    automatic optimization, one optimizer and no resume (Lightning counts its own
    ``_batches_that_stepped``), and the property also knows the active loop. Without the
    attribute, every step counts (more ``self.log`` calls, the same logs).

    Args:
        trainer: the running trainer.

    Returns:
        True on the steps whose metrics Lightning keeps.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


def lightning_logging_step(trainer: pl.Trainer) -> Optional[int]:
    """The step Lightning logs training metrics at: ``fit_loop.epoch_loop._batches_that_stepped``.

    Assumes the counter exists, counts optimizer-stepping batches (``global_step`` with automatic
    optimization and one optimizer) and is the ``step`` Lightning's logger connector passes to the
    loggers and decides ``log_every_n_steps`` by. No public API exposes it (``global_step`` counts
    optimizer steps, and differs after a restart, see ``mmssl.callbacks.log_step``).

    Returns:
        The counter, or ``None`` where this Lightning has none.
    """
    return getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None)


def set_lightning_logging_step(trainer: pl.Trainer, step: int) -> None:
    """Set the counter :func:`lightning_logging_step` reads (no public setter exists).

    Args:
        trainer: the running trainer.
        step: the value the next training batch's metrics are logged after (``step + 1``).
    """
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def weight_averaging_model(callback: Any) -> Optional[nn.Module]:
    """The ``AveragedModel`` of Lightning's ``WeightAveraging`` callback (``None`` before ``fit``).

    Assumes ``WeightAveraging._average_model``, which its ``setup`` creates on ``fit`` and its
    other hooks (the update after each step, the swap around validation, the checkpoint's
    averaged ``state_dict``, the copy at the end) all read. No public getter exists.

    Args:
        callback: a ``WeightAveraging`` (or subclass).

    Returns:
        The ``torch.optim.swa_utils.AveragedModel``, or ``None``.
    """
    return callback._average_model


def set_weight_averaging_model(callback: Any, model: nn.Module) -> None:
    """Give ``WeightAveraging`` the ``AveragedModel`` its hooks update, swap and save.

    For a subclass whose ``setup`` builds the average itself (mmssl's EMA: its own ``multi_avg_fn``
    and no ``configure_model`` warning). Assumes what :func:`weight_averaging_model` does, and that
    ``WeightAveraging.setup`` sets nothing but that attribute, so a ``setup`` that calls this
    instead loses nothing. No public setter exists.

    Args:
        callback: a ``WeightAveraging``.
        model: a ``torch.optim.swa_utils.AveragedModel`` of the LightningModule.
    """
    callback._average_model = model


def set_averaged_module(average: nn.Module, module: nn.Module) -> None:
    """Make ``module`` (a copy made by the caller) the module that the ``AveragedModel``
    ``average`` updates, saves and loads.

    Assumes ``torch.optim.swa_utils.AveragedModel`` keeps its copy as the submodule ``module``
    that ``update_parameters`` and ``state_dict`` (``module.`` keys) read, and that its
    constructor does nothing to the copy but ``deepcopy`` and ``to(device)``. No public way passes
    a ready copy: the constructor deep-copies what it is given, and a LightningModule under FSDP2
    refers to its device mesh (process groups, which cannot be copied) and LightningCLI's
    optimizer factories (which hold locks); mmssl's EMA copies those by reference and builds the
    AveragedModel on ``nn.Identity()``.

    Args:
        average: an ``AveragedModel``.
        module: the copy of the model to average into.
    """
    average.module = module


# torch FSDP2 -------------------------------------------------------------------------------------


def fsdp2_lazy_init(module: nn.Module) -> None:
    """Make the FSDP2-sharded ``module`` the root of its sharded units now, as its first forward would.

    FSDP2 decides its root lazily, at the first forward: a unit whose forward runs first (a
    callback calling ``encode_text``, which enters an inner block) makes itself a root, and every
    later forward through ``module`` then fails ("requires running forward through the root module
    first"). A module that never trains (the EMA's sharded copy, a model in ``mmssl validate``) has
    had no such forward when evaluation calls its named stages. Assumes ``FSDPModule._get_fsdp_state``
    and ``FSDPState._lazy_init`` (torch ``distributed/fsdp/_fully_shard``), which the root pre-forward
    calls and which is a no-op once done; no public API runs it.

    Args:
        module: the module ``fully_shard`` was applied to last (the root).
    """
    module._get_fsdp_state()._lazy_init()


def fsdp2_forget_forward_order(module: nn.Module) -> None:
    """Forget the unit forwards FSDP2 recorded since the last backward, on every unit of ``module``.

    FSDP2 appends each unit's forward to one list, kept until a backward ends, and each unit's
    backward prefetches (all-gathers) the unit recorded just before its own forward. Forwards run
    outside training (an evaluation on gathered weights, where ranks run different numbers of
    batches or rank 0 alone runs a callback's encoder) stay in that list, so the first training
    backward then prefetches on some ranks a unit that others do not: a collective on one rank only
    (the CLIP + MLM hang of #47). Called on every rank after each evaluation, so training's
    backward sees its own forwards only. Assumes ``FSDPModule._get_fsdp_state``,
    ``FSDPState._fsdp_param_groups`` and ``FSDPParamGroup.comm_ctx.post_forward_order`` /
    ``_post_forward_indices`` (torch ``distributed/fsdp/_fully_shard/_fsdp_param_group.py``:
    ``_record_post_forward``, ``_backward_prefetch``), which FSDP2 clears itself only when a
    backward ends; no public API clears them.
    """
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                group.comm_ctx.post_forward_order.clear()
                group._post_forward_indices.clear()


# torch optimizers --------------------------------------------------------------------------------


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` reads a ``found_inf`` flag set by :func:`set_found_inf`.

    Assumes torch's ``_step_supports_amp_scaling`` attribute, which ``GradScaler`` reads to hand
    such an optimizer its ``found_inf`` instead of reading the flag on the host (torch
    ``amp/grad_scaler.py``); fused Adam/AdamW set it. No public API asks an optimizer this.

    Args:
        optimizer: any optimizer.

    Returns:
        True for an optimizer whose step takes ``found_inf``.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def set_found_inf(optimizer: torch.optim.Optimizer, flag: Tensor) -> None:
    """Make the next ``optimizer.step`` skip on the device when ``flag`` (a 0-d float) is non-zero.

    Assumes fused Adam's step passes ``getattr(self, "found_inf", None)`` to the fused kernel,
    which then leaves parameters and moments alone and takes the step count back (torch
    ``optim/adam.py``, ``_fused_adam``). That is how ``GradScaler`` skips without a host read; no
    public API skips a step on a device flag, and ``GradScaler`` itself exists only for fp16.

    Args:
        optimizer: an optimizer for which :func:`takes_found_inf` holds.
        flag: 0-d float tensor, 1.0 to skip, 0.0 to step.
    """
    optimizer.found_inf = flag


def clear_found_inf(optimizer: torch.optim.Optimizer) -> None:
    """Remove the flag :func:`set_found_inf` set, so a later step does not read a stale one."""
    if hasattr(optimizer, "found_inf"):
        del optimizer.found_inf


# torch wrappers and norm layers ------------------------------------------------------------------

# Prefixes that torch's wrappers insert into the parameter names of the module they wrap: FSDP 1
# (``FullyShardedDataParallel``'s ``_fsdp_wrapped_module``), activation checkpointing
# (``checkpoint_wrapper``'s ``_checkpoint_wrapped_module``) and ``torch.compile``
# (``OptimizedModule._orig_mod``). FSDP2's ``fully_shard`` inserts none (it swaps parameters for
# DTensors in place), nor does DDP (its ``module.`` sits outside the LightningModule's names).
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    """A parameter's name as the module was built, with wrapper prefixes removed.

    Assumes :data:`WRAPPER_PREFIXES` are what the wrappers insert; no public API maps a wrapped
    name back (FSDP 1's ``clean_tensor_name`` is private, compile and checkpointing have none).

    Args:
        name: e.g. ``visual._fsdp_wrapped_module.blocks.0.weight``.

    Returns:
        e.g. ``visual.blocks.0.weight``.
    """
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def is_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a torch batch norm of any kind (1d/2d/3d, lazy, sync, subclasses
    such as timm's ``BatchNormAct2d``).

    Assumes they all derive from torch's ``nn.modules.batchnorm._BatchNorm``, the base that holds
    the running statistics; torch offers no public base class for them (``_NormBase`` is private
    too, and also the base of the instance norms).
    """
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


# torch DistributedDataParallel ---------------------------------------------------------------------


def ddp_buffer_sync_state(model: nn.parallel.DistributedDataParallel) -> tuple[bool, bool]:
    """DDP's ``(broadcast_buffers, require_forward_param_sync)``: whether its next forward
    broadcasts the module's buffers from rank 0.

    Assumes DDP's forward broadcasts exactly when both are true (torch ``_pre_forward``,
    ``will_sync_module_buffers``) and that each forward sets ``require_forward_param_sync`` (True
    with gradients enabled, else False, in ``_post_forward``). ``broadcast_buffers`` is a public
    constructor argument; the flag has no public API, and ``no_sync()`` only stops the gradient
    all-reduce.

    Args:
        model: the DDP wrapper.

    Returns:
        The two flags, to be put back with :func:`set_ddp_buffer_sync_state`.
    """
    return bool(model.broadcast_buffers), bool(model.require_forward_param_sync)


def set_ddp_buffer_sync_state(model: nn.parallel.DistributedDataParallel, state: tuple[bool, bool]) -> None:
    """Set what :func:`ddp_buffer_sync_state` reads.

    Args:
        model: the DDP wrapper.
        state: ``(broadcast_buffers, require_forward_param_sync)``.
    """
    model.broadcast_buffers, model.require_forward_param_sync = state


# open_clip ---------------------------------------------------------------------------------------


def open_clip_encode_text_prefix(model: nn.Module, tokens: Tensor, normalize: bool = True) -> Tensor:
    """open_clip's ``CLIP.encode_text`` on a batch cut to its first ``L < context_length`` tokens.

    The body of open_clip's ``CLIP.encode_text`` (open_clip 3.x ``model.py``), with the positional
    embedding and the causal mask cut to ``L``: the public method always adds all
    ``context_length`` positions, so it refuses a shorter batch. Assumes that body, which the
    test compares against the public method on padded tokens; only for a text tower where the
    padding is inert (``mmssl.models.open_clip_config.text_padding_is_inert``).

    Args:
        model: an ``open_clip.CLIP``.
        tokens: (B, L) token ids.
        normalize: L2-normalise the output.

    Returns:
        (B, D) text embeddings.
    """
    from open_clip.transformer import text_global_pool  # public since open_clip 3.1

    length = tokens.shape[1]
    x = model.token_embedding(tokens).to(model.transformer.get_cast_dtype())  # (B, L, W)
    x = x + model.positional_embedding[:length].to(x.dtype)
    x = model.transformer(x, attn_mask=model.attn_mask[:length, :length])
    x = model.ln_final(x)
    x = text_global_pool(x, tokens, model.text_pool_type, eos_token_id=getattr(model, "text_eos_id", None))  # (B, W)
    if model.text_projection is not None:
        x = model.text_projection(x) if isinstance(model.text_projection, nn.Linear) else x @ model.text_projection
    return F.normalize(x, dim=-1) if normalize else x


def open_clip_coca_sampling() -> None:
    """Let open_clip's ``CoCa.generate`` sample (``top_k`` / ``top_p``) under transformers 5.

    open_clip 3.3's ``coca_model`` imports its logits processors and stopping criteria from
    transformers in one ``try`` together with ``BeamSearchScorer``, which transformers 5 removed;
    the whole import then fails, ``_has_transformers`` is False and ``generate`` refuses every
    generation type, though only beam search needs the removed class. Assumes those module globals
    (``_has_transformers``, ``GENERATION_TYPES`` and the names the sampling loop reads); sets them
    from transformers' still-public classes. Beam search stays with mmssl's own
    (:func:`mmssl.models.generation.beam_search`). No public switch exists. Idempotent.
    """
    from open_clip import coca_model

    if coca_model._has_transformers:
        return
    import transformers

    for name in ("LogitsProcessorList", "TopPLogitsWarper", "TopKLogitsWarper", "RepetitionPenaltyLogitsProcessor",
                 "MinLengthLogitsProcessor", "MaxLengthCriteria", "StoppingCriteriaList"):
        setattr(coca_model, name, getattr(transformers, name))
    coca_model.GENERATION_TYPES.update(top_k=transformers.TopKLogitsWarper, top_p=transformers.TopPLogitsWarper)
    coca_model._has_transformers = True


# timm --------------------------------------------------------------------------------------------


def replace_timm_augment_fn(transform: Any, old: Callable, new: Callable) -> int:
    """Swap the image function of timm's RandAugment ops from ``old`` to ``new``.

    Assumes the transform built by ``timm.data.create_transform`` is a ``Compose`` whose
    ``transforms`` include timm's ``RandAugment`` (or ``AugMixAugment``), holding its ops as
    ``.ops``: ``AugmentOp`` objects, each applying ``aug_fn(img, *level_args, **kwargs)``.
    timm has no public hook to replace one op's function (its op table ``NAME_TO_OP`` is read
    when the transform is built, so patching it would change every later transform).

    Args:
        transform: what ``create_transform`` returned.
        old: the timm function to replace (e.g. ``timm.data.auto_augment.posterize``).
        new: a function with the same signature.

    Returns:
        How many ops were changed.
    """
    changed = 0
    for op in getattr(transform, "transforms", ()):
        for aug in getattr(op, "ops", ()):
            if getattr(aug, "aug_fn", None) is old:
                aug.aug_fn = new
                changed += 1
    return changed


# transformers ------------------------------------------------------------------------------------


def transformers_config_origin(config: Any) -> str:
    """The Hub repository a transformers folder was downloaded from, as its ``config.json`` records
    it, or ``""`` where it records none.

    Assumes the ``_name_or_path`` key that transformers 4 wrote into every ``config.json`` it saved
    (so into the Hub's files: ``"openai/clip-vit-base-patch32"``) comes back, on
    ``PretrainedConfig.from_pretrained`` of the local folder, as the config's public
    ``name_or_path``. transformers 5 no longer writes the key; such folders give ``""``. No public
    API records where a folder came from.

    Args:
        config: a ``transformers.PretrainedConfig`` read from a local folder.

    Returns:
        The repository name, or ``""``.
    """
    return config.name_or_path or ""
