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

Objectives sit below the models in the layers (they import no model): the model that composes
them names them by their registered name (:data:`OBJECTIVES`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping, Optional, Union

from torch import Tensor, nn

from mmssl.errors import ConfigError


class Objective(nn.Module):
    """One pretext task's loss.

    Args:
        weight: the term's weight in the sum (>= 0); 0 leaves the term out.
        start: when it starts: a step (``int`` >= 0) or a fraction of the run's optimizer steps
            (``float`` in [0, 1)); before it the term is weighted 0 (see the module docstring).
    """

    name: ClassVar[str] = ""
    order: ClassVar[int] = 100  # the place of its term in the sum and of its random draws: lower first
    parts: ClassVar[tuple[str, ...]] = ()
    joint: ClassVar[bool] = False

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

    def chunk(self, out: Mapping[str, Tensor]) -> Optional[Tensor]:
        """What a GradCache chunk keeps of its joint forward for this objective (a small reduction
        of outputs too large to keep, like a decoder's logits), or ``None``: nothing."""
        return None

    def forward(self, out: Mapping[str, Any], batch: Mapping[str, Tensor], weight: float) -> Tensor:
        """This rank's weighted term of a training step (its mean over ranks: the global batch's)."""
        raise NotImplementedError

    def validation(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        """The unweighted term of one validation batch against its own negatives; keeps its figures."""
        raise NotImplementedError

    def log_validation(self, module: Any) -> None:
        """Log the figures kept by :meth:`validation` (on every rank), ``val/<name>_loss`` first."""


OBJECTIVES: dict[str, type[Objective]] = {}  # name -> class, in the order the terms are summed (``order``)


def register(cls: type[Objective]) -> type[Objective]:
    """Class decorator: ``cls`` becomes the objective named ``cls.name`` in a model's ``objectives``."""
    OBJECTIVES[cls.name] = cls
    for name in sorted(OBJECTIVES, key=lambda n: (OBJECTIVES[n].order, n)):
        OBJECTIVES[name] = OBJECTIVES.pop(name)
    return cls


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


def check_parts(objectives: Mapping[str, Objective], model: nn.Module, model_name: str) -> None:
    """Refuse, at start-up, an objective whose parts ``model`` lacks, naming both."""
    for name, objective in objectives.items():
        missing = [p for p in objective.parts if getattr(model, p, None) is None]
        if missing and objective.weight > 0:
            raise ConfigError(f"model.init_args.objectives.{name}: needs the model part(s) {missing}, which "
                              f"{model_name!r} ({type(model).__name__}) does not have")
