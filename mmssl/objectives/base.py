"""How a model is trained, apart from what it is: an objective is one pretext task's loss over
the outputs of a model's forward (issue #54; open_clip main's ``task/`` composes a model with its
loss the same way, ``base_task.TrainingTask``).

An objective declares what it reads (``parts``: attributes of the towers' module, e.g. open_clip's
``text_decoder``; ``joint``: the model's joint forward, a decoder over the image tokens, rather
than the two towers apart), so a combination that cannot train is refused at start-up naming the
objective and what is missing (:func:`check_parts`), and no model keeps a list of refusals. It
returns this rank's share of the global-batch loss, weighted, and may start late: at a step
(an ``int``) or at a fraction of the run's steps (a ``float`` below 1; SigLIP 2 adds two of its
terms at 80%). Before its start the term is computed and weighted 0, so its parameters stay in
DDP's graph and every random draw happens in the same order as after it: a run resumed across the
start is bit-exact.

Some objectives act before the forward as well as after it (BERT's masked words corrupt the captions
the text tower reads; MAE-style masking will drop patches): :meth:`Objective.prepare` adds to the
step's batch what the forward then reads (``inputs``: taken by the host's forward by keyword) and
what the term is scored against (targets), in the objectives' order. Their random draws are the
host's, handed out in that order from one per-sample stream (:meth:`Objective.draws`): in training
each sample's uniforms are seeded by (run seed, step, the sample's index in the global batch)
(:func:`sample_uniforms`), so N ranks draw what one process draws on the concatenated batch and a
resume draws again what it drew; in validation by the sample's pixels, so a sample is scored alike
whichever rank or batch it lands in. An objective may also read parts of the module that trains it
(``host_parts``: a head of the preset that builds it, e.g. ``mlm_head``): those are model parts, in
the host's checkpoint, and the objective reads them through :attr:`Objective.host`.

Objectives sit below the models in the layers (they import no model): the model that composes
them names them by their registered name (:data:`OBJECTIVES`).
"""

from __future__ import annotations

import abc
import inspect
import math
from typing import Any, ClassVar, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mmssl.distributed import is_distributed, world_size
from mmssl.errors import ConfigError


class Objective(nn.Module, abc.ABC):
    """One pretext task's loss (abstract: a subclass that lacks ``forward`` or ``validation``
    fails when it is built, not at its first step).

    Args:
        weight: the term's weight in the sum (>= 0); 0 leaves the term out.
        start: when it starts: a step (``int`` >= 0) or a fraction of the run's optimizer steps
            (``float`` in [0, 1)); before it the term is weighted 0 (see the module docstring).
    """

    name: ClassVar[str] = ""
    order: ClassVar[int] = 100  # the place of its term in the sum and of its random draws: lower first
    parts: ClassVar[tuple[str, ...]] = ()  # attributes of the towers' module (``host.model``) it reads
    host_parts: ClassVar[tuple[str, ...]] = ()  # attributes of the host module it reads (a preset's heads)
    inputs: ClassVar[tuple[str, ...]] = ()  # what its prepare returns for the host's forward, by keyword
    joint: ClassVar[bool] = False
    chunked: ClassVar[bool] = True  # False: it reads the whole batch's outputs at once (no GradCache)
    # Why the objective cannot train a model sharded by FSDP2 yet, or None: refused at start-up
    # (the host's ``sharding_refusal``, :func:`mmssl.sharding.shard_model`) rather than a crash at a step.
    unsharded: ClassVar[Optional[str]] = None

    def __init__(self, weight: float = 1.0, start: Union[int, float] = 0) -> None:
        super().__init__()
        key = f"model.init_args.objectives.{self.name}"
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{key}.weight: a number >= 0, got {weight!r}")
        limit = 1 if isinstance(start, float) else math.inf  # a float is a fraction of the run
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not 0 <= start < limit:
            raise ConfigError(f"{key}.start: a step (an integer >= 0) or a fraction of the run in [0, 1), "
                              f"got {start!r}")
        self.weight = float(weight)
        self.start: Union[int, float] = start

    def first_step(self, total_steps: int) -> int:
        """The first optimizer step (0-based) at which the term counts, in a run of ``total_steps``."""
        if isinstance(self.start, float):
            return math.ceil(self.start * total_steps)
        return self.start

    def weight_at(self, step: int, total_steps: int) -> float:
        """The weight of the term at optimizer step ``step`` (0 before its start)."""
        return self.weight if step >= self.first_step(total_steps) else 0.0

    def bind(self, model: nn.Module) -> None:
        """Read what the objective takes from the built model (a padding id, ...); after :func:`check_parts`."""

    def check(self, host: nn.Module, model_name: str) -> None:
        """Refuse, at start-up, a model the objective cannot train though it has the parts (a causal
        text tower for masked words, ...): raise :class:`~mmssl.errors.ConfigError` naming the key."""

    def check_run(self, trainer: Any, stage: str) -> None:
        """Refuse, at start-up (the host's ``setup``), a run the objective cannot train: a callback
        or a batch field it needs that the run lacks; raise :class:`~mmssl.errors.ConfigError` naming the key."""

    @property
    def host(self) -> nn.Module:
        """The module that trains the objective (set by :func:`check_parts`): its ``host_parts``."""
        host = self.__dict__.get("_host")
        if host is None:
            raise RuntimeError(f"objective {self.name!r} has no host module yet (check_parts attaches it)")
        return host

    def draws(self, batch: Mapping[str, Tensor], training: bool) -> int:
        """How many uniforms per sample the objective draws this step (handed to :meth:`prepare`)."""
        return 0

    def prepare(self, host: nn.Module, batch: Mapping[str, Tensor], uniforms: Optional[Tensor],
                training: bool) -> dict[str, Tensor]:
        """What the objective adds to the step's batch before the forward, under names of its own.

        Called in the objectives' order, each seeing what those before it added. The entries named
        in ``inputs`` are passed to the host's forward by keyword; every entry reaches :meth:`forward`
        and :meth:`validation` in their ``batch``.

        Args:
            host: the module that trains it (its named stages: masking in its vocabulary, ...).
            batch: ``image`` (B, 3, H, W), ``text`` (B, L) and what earlier objectives added.
            uniforms: (B, :meth:`draws`) this rank's uniforms in [0, 1), or ``None`` when it draws none.
            training: a training step (else a validation one: no collective, a rank may have no batch).
        """
        return {}

    def chunk(self, out: Mapping[str, Tensor]) -> Optional[Tensor]:
        """What a GradCache chunk keeps of its joint forward for this objective (a small reduction
        of outputs too large to keep, like a decoder's logits), or ``None``: nothing."""
        return None

    @abc.abstractmethod
    def forward(self, out: Mapping[str, Any], batch: Mapping[str, Tensor], weight: float) -> Tensor:
        """This rank's weighted term of a training step (its mean over ranks: the global batch's)."""

    @abc.abstractmethod
    def validation(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        """The unweighted term of one validation batch against its own negatives; keeps its figures."""

    def log_validation(self, module: Any) -> None:
        """Log the figures kept by :meth:`validation` (on every rank), ``val/<name>_loss`` first."""

    def log_training(self, module: Any) -> None:
        """Log the figures of the last training step that :meth:`forward` kept (beside its
        ``train/<name>_loss``), on the host's logging steps."""


OBJECTIVES: dict[str, type[Objective]] = {}  # name -> class, in the order the terms are summed (``order``)


def register(cls: type[Objective]) -> type[Objective]:
    """Class decorator: ``cls`` becomes the objective named ``cls.name`` in a model's ``objectives``."""
    OBJECTIVES[cls.name] = cls
    for name in sorted(OBJECTIVES, key=lambda n: (OBJECTIVES[n].order, n)):
        OBJECTIVES[name] = OBJECTIVES.pop(name)
    return cls


PARTS: dict[str, type[nn.Module]] = {}  # name -> a model part an objective builds as its own head


def register_part(name: str):
    """Class decorator: ``cls`` becomes the part an objective builds by ``name`` (:func:`build_part`).

    A part is what a model is (MAE's pixel decoder, in :mod:`mmssl.models`); an objective that
    trains a model through a head of its own builds that head from the model's sizes in
    :meth:`Objective.bind`. The models sit above the objectives in the layers, so they register
    their parts here rather than the objectives importing them (timm's ``register_model`` likewise)."""
    def add(cls: type[nn.Module]) -> type[nn.Module]:
        PARTS[name] = cls
        return cls
    return add


def build_part(name: str, key: str, **sizes: Any) -> nn.Module:
    """The registered part ``name`` built with ``sizes``; a size it refuses raises
    :class:`~mmssl.errors.ConfigError` naming the objective's ``key``."""
    if name not in PARTS:  # registered when mmssl.models is imported, which every host does
        raise RuntimeError(f"{key}: no model part {name!r} is registered (import mmssl.models first); known: "
                           f"{sorted(PARTS)}")
    try:
        return PARTS[name](**sizes)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None


def build_objectives(spec: Mapping[str, Optional[Mapping[str, Any]]], defaults: Mapping[str, Mapping[str, Any]],
                     key: str = "model.init_args.objectives") -> dict[str, Objective]:
    """The objectives of ``spec`` (name -> options, ``null``: the defaults) over ``defaults``, in
    :data:`OBJECTIVES`' order (the order of the sum and of the random draws, whatever the YAML's).

    Raises:
        ConfigError: an unknown name (the known ones listed) or an option the objective lacks.
    """
    merged: dict[str, dict[str, Any]] = {name: dict(options) for name, options in defaults.items()}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{key}: a mapping of objective names to their options, got {spec!r}")
    for name, options in spec.items():
        if name not in OBJECTIVES:
            raise ConfigError(f"{key}.{name}: no such objective; known: {sorted(OBJECTIVES)}")
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"{key}.{name}: a mapping of its options (weight, start, ...), got {options!r}")
        merged[name] = {**merged.get(name, {}), **(options or {})}
    built = {}
    for name, cls in OBJECTIVES.items():
        if name in merged:
            try:
                built[name] = cls(**merged[name])
            except TypeError as err:
                raise ConfigError(f"{key}.{name}: {err}") from None
    return built


def has_parts(objective: Objective, model: nn.Module, host: Optional[nn.Module] = None) -> bool:
    """Whether ``model`` (the towers) and ``host`` (the module around them) have the objective's parts."""
    return not _missing(objective, model, host)


def _missing(objective: Objective, model: nn.Module, host: Optional[nn.Module]) -> list[str]:
    """The parts it lacks: of ``model``, and of ``host`` where one is given."""
    missing = [p for p in objective.parts if getattr(model, p, None) is None]
    if host is None:
        return missing
    takes = inspect.signature(host.forward).parameters
    return (missing + [p for p in objective.host_parts if getattr(host, p, None) is None]
            + [f"forward input {i!r}" for i in objective.inputs if i not in takes])


def check_parts(objectives: Mapping[str, Objective], model: nn.Module, model_name: str,
                host: Optional[nn.Module] = None) -> None:
    """Refuse, at start-up, an objective whose parts ``model`` lacks, naming both. Given ``host`` (the
    module around ``model``, once it has every part), also its ``host_parts`` and the forward inputs
    its ``prepare`` returns; then each objective checks the model (:meth:`Objective.check`) and is
    attached to ``host`` (:attr:`Objective.host`)."""
    for name, objective in objectives.items():
        if objective.weight > 0:
            missing = _missing(objective, model, host)
            owner = type(host if objective.host_parts and host is not None else model).__name__
            if missing:
                raise ConfigError(f"model.init_args.objectives.{name}: needs the model part(s) {missing}, which "
                                  f"{model_name!r} ({owner}) does not have")
        if host is not None:
            # A plain attribute, not a submodule: the host's parameters stay its own (checkpoint keys).
            objective.__dict__["_host"] = host
            if objective.weight > 0:
                objective.check(host, model_name)


def sample_uniforms(seed: int, step: int, first_row: int, rows: int, width: int, device: torch.device) -> Tensor:
    """(rows, width) uniforms, row i from a generator seeded by (seed, step, first_row + i).

    The draws for a sample depend on its index in the global batch and on the step only, not on
    the number of ranks it is split over nor on a resume: one process on the concatenated batch
    draws what N ranks draw. Costs one small CPU generator per sample and step.
    """
    out = [torch.rand(width, generator=torch.Generator().manual_seed(
        ((seed * 1_000_003 + step) * 1_000_003 + first_row + i) & (2**63 - 1))) for i in range(rows)]
    return torch.stack(out).to(device) if out else torch.zeros(0, width, device=device)


def image_width(model: nn.Module, name: str, what: str) -> int:
    """The image tower's ``what`` (``output_dim`` or the token width), refused for a tower without it."""
    visual = getattr(model, "visual", None)
    if visual is None or not hasattr(visual, "forward_intermediates") or not hasattr(visual, "positional_embedding"):
        raise ConfigError(f"model.init_args.objectives.{name}: needs an open_clip ViT image tower (with "
                          f"forward_intermediates and a position embedding), got {type(visual).__name__}")
    return int(visual.output_dim) if what == "pooled" else int(visual.positional_embedding.shape[-1])


class RowsObjective(Objective):
    """An objective whose term is the mean of a per-row loss (:meth:`rows`: a crop's, a masked
    patch's): its validation figure is ``val/<name>_loss``, the unweighted mean over every row of
    the set (each batch weighted by its rows, summed over ranks)."""

    @abc.abstractmethod
    def rows(self, out: Mapping[str, Any], batch: Mapping[str, Tensor]) -> Tensor:
        """(N,) the loss of each row of the batch."""

    def validation(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        rows = self.rows(out, batch)
        loss = rows.mean()
        self.val_loss.update(loss.detach(), weight=rows.numel())
        return loss

    def log_validation(self, module: Any) -> None:
        module.log(f"val/{self.name}_loss", self.val_loss)

    @staticmethod
    def global_mean(rows: Tensor, weight: float) -> Tensor:
        """This rank's share of ``weight`` x the mean of ``rows`` over every rank's rows: its sum
        over the global count, times the world size (DDP averages the ranks' gradients), so ranks of
        unequal row counts train what one process trains on their concatenation."""
        total = torch.tensor(float(rows.numel()), device=rows.device)
        if is_distributed():
            dist.all_reduce(total)  # every rank's rows
        return weight * rows.sum() * world_size() / total
