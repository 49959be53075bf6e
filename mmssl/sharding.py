"""FSDP2: each model states its sharding units, one function applies ``fully_shard``.

Lightning's ``ModelParallelStrategy`` (FSDP2 through ``torch.distributed.fsdp.fully_shard``)
calls the module's ``configure_model`` once the process group and device mesh exist, and
leaves the sharding to it (its docs; torchtitan's ``parallelize``). A model that applies no
``fully_shard`` there trains one unsynchronised replica per rank without a word, so every mmssl
model shards through :func:`shard_model`, and :func:`check_sharded` refuses a model that did not.

Units are the transformer blocks (timm's ``Block``, open_clip's residual blocks), each one
all-gathered just before its forward and freed after it, then the root, which holds what is left
(embeddings, norms, heads, ``logit_scale``): the layout of torchtitan and of open_clip's FSDP2
path. Parameter names (FQNs) are unchanged by ``fully_shard``, so weight-decay groups, checkpoints
and exports read the same keys as under DDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

# The transformer blocks of the towers mmssl builds (timm ViTs: MAE, ImageClassifier, timm image
# towers; open_clip: CLIP and CoCa towers, CoCa's multimodal decoder), by class name so that no
# block class is imported here (the ground floor imports no model library).
BLOCK_CLASSES = frozenset({
    "timm.models.vision_transformer.Block",
    "timm.models.vision_transformer.ResPostBlock",
    "timm.models.eva.EvaBlock",
    "open_clip.transformer.ResidualAttentionBlock",
    "open_clip.transformer.CustomResidualAttentionBlock",
})

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ShardingPolicy:
    """How :func:`shard_model` shards (the FSDP2 keys of ``configs/trainer/fsdp2*.yaml``).

    Attributes:
        param_dtype: dtype parameters are all-gathered and computed in (``bfloat16`` on GPUs;
            ``None``: the parameters' own, fp32). The sharded master copy and the optimizer stay fp32.
        reduce_dtype: dtype gradients are reduce-scattered in (``float32`` keeps the reduction
            exact under bf16 compute; ``None``: ``param_dtype``'s).
        reshard_after_forward: free each block's gathered parameters after its forward and gather
            them again for the backward (ZeRO-3, least memory); ``False`` keeps them until the
            backward (ZeRO-2-like: one all-gather less per block and step, more memory).
    """

    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None and value not in DTYPES:
                raise ValueError(f"trainer.strategy.init_args.{key}: {value!r} is not one of {sorted(DTYPES)}")

    def fully_shard_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``fully_shard`` other than the module and mesh."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        if self.param_dtype is not None or self.reduce_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=DTYPES.get(self.param_dtype or ""), reduce_dtype=DTYPES.get(self.reduce_dtype or ""))
        return kwargs


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The outermost transformer blocks of ``module`` (:data:`BLOCK_CLASSES`), in module order.

    A frozen block (a locked tower's, LiT) is a unit too: FSDP2 shards frozen parameters as it
    shards trained ones, so a locked tower costs 1/N of its memory per rank.
    """
    units: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if _class_name(child) in BLOCK_CLASSES:
                units.append(child)
            else:
                walk(child)

    walk(module)
    return units


def is_fsdp2(module: nn.Module) -> bool:
    """Whether ``fully_shard`` has been applied to ``module`` itself."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_model(module: nn.Module, trainer: Any) -> bool:
    """``fully_shard`` each transformer block of ``module``, then ``module`` itself, when
    ``trainer`` runs Lightning's ``ModelParallelStrategy``; a no-op under any other strategy and
    when already sharded (``configure_model`` may be called again).

    Args:
        module: the LightningModule (from its ``configure_model``).
        trainer: its trainer, or ``None`` outside one.

    A distillation teacher is no submodule of the student (``mmssl.models.teacher``): it stays
    whole and frozen on every rank, outside the sharding, as it stays outside DDP.

    Returns:
        Whether ``module`` was sharded here.

    Raises:
        ValueError: tensor parallelism was asked for (``tensor_parallel_size`` > 1): mmssl's
            models shard data-parallel only; or the model's ``sharding_refusal()`` names a reason
            (LoRA adapters), at start-up, naming the model and the key.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = getattr(trainer, "strategy", None)
    if not isinstance(strategy, ModelParallelStrategy) or is_fsdp2(module):
        return False
    refusal = getattr(module, "sharding_refusal", lambda: None)()
    if refusal:
        raise ValueError(f"{type(module).__name__} under {type(strategy).__name__} (FSDP2): {refusal}")
    mesh = strategy.device_mesh
    if mesh["tensor_parallel"].size() != 1:
        raise ValueError(f"{type(module).__name__}: trainer.strategy.init_args.tensor_parallel_size must be 1 "
                         f"(mmssl shards data-parallel with FSDP2), got {mesh['tensor_parallel'].size()}")
    shard_module(module, mesh["data_parallel"], getattr(strategy, "policy", None) or ShardingPolicy())
    return True


def shard_module(module: nn.Module, mesh: Any, policy: ShardingPolicy) -> None:
    """``fully_shard`` each of :func:`shard_units` on ``mesh`` (a 1-D data-parallel device mesh),
    then ``module`` itself: what :func:`shard_model` does inside a Lightning run."""
    from torch.distributed.fsdp import fully_shard

    kwargs = policy.fully_shard_kwargs()
    for unit in shard_units(module):
        fully_shard(unit, mesh=mesh, **kwargs)
    # The root's parameters (embeddings, norms, heads): the last all-gather of the forward. The
    # root stays gathered after the forward (its backward comes first), as torchtitan does.
    fully_shard(module, mesh=mesh, **{**kwargs, "reshard_after_forward": False})
    # FSDP2 gathers a unit's parameters in hooks on its ``forward``; a model whose training step
    # enters its network through another method (CoCa's ``losses`` calls open_clip's model, not
    # the LightningModule) names it, and that method gathers the root's parameters too.
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in getattr(module, "fsdp_forward_methods", ()):
        register_fsdp_forward_method(module, name)


def check_sharded(module: nn.Module, trainer: Any) -> None:
    """Refuse, before the first step, a ``ModelParallelStrategy`` run whose model applied no
    ``fully_shard`` (each rank would train its own replica, unsynchronised).

    Raises:
        ValueError: naming the model class.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if isinstance(getattr(trainer, "strategy", None), ModelParallelStrategy) and not is_fsdp2(module):
        raise ValueError(
            f"{type(module).__name__} does not support ModelParallelStrategy (FSDP2): its configure_model applies no "
            "fully_shard, so every rank would train an unsynchronised replica; use DDP (configs/trainer/ddp.yaml), "
            "or call mmssl.sharding.shard_model(self, self.trainer) in its configure_model")
