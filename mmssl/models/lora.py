"""LoRA (Hu et al. 2021) on mmssl's towers through Hugging Face ``peft``, and LoRA checkpoints.

``model.lora: {r, alpha, dropout, target_modules, towers, trainable}`` on ``CLIP`` or
``ImageClassifier`` freezes the model, injects low-rank adapters into the named layers with
``peft.inject_adapter_in_model`` (peft's public API for models that are not ``PeftModel``s) and
leaves trainable only the adapters and the ``trainable`` parameters (CLIP: ``logit_scale`` /
``logit_bias``; ImageClassifier: the new head and ``fc_norm``).

What is adapted by default, per tower (``target_modules`` unset):

* open_clip ``VisionTransformer`` / ``TextTransformer`` (``ResidualAttentionBlock``): ``attn``,
  the ``nn.MultiheadAttention`` (peft adapts its fused ``in_proj`` q/k/v weight and its
  ``out_proj`` together: it merges the low-rank update into both for each forward), and the MLP's
  ``c_fc`` and ``c_proj`` Linear layers.
* timm ViTs (ImageClassifier's model, a CLIP's ``TimmModel`` trunk): every block's ``attn.qkv``,
  ``attn.proj``, ``mlp.fc1`` and ``mlp.fc2`` Linear layers (not the patch embedding's conv).

A LoRA checkpoint holds only what trains, plus the base it was trained on as ``lora_base``:
``{argument: {"path", "sha256"}}`` for ``pretrained`` / ``init_encoder`` / ``image_tower_init``.
:mod:`mmssl.checkpoints.load` rebuilds the base from those files (refusing a missing or changed
one, naming it) and then loads the adapters; :func:`merge_lora` folds them into the weights for
every export, so the exported files need no peft.

A LoRA checkpoint also records the peft it trained under (``lora_peft``): peft before 0.22 applied
a ``nn.MultiheadAttention``'s ``out_proj`` update twice (its forward and ``merge`` made W + 2 dW;
huggingface/peft PR #3774), 0.22 once, so the same adapter tensors are another model under another
peft. Every load converts (:func:`match_installed_peft`: ``out_proj``'s ``lora_B`` scaled by the
ratio) so the model computes what it trained as, whichever peft is installed.

peft is the ``lora`` extra (``pip install -e '.[lora]'``), imported only when LoRA is asked for.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

# The checkpoint entry naming the base files (a top-level key beside "state_dict").
LORA_BASE = "lora_base"
# The checkpoint entry naming the peft version the adapters trained under (see the module docstring).
LORA_PEFT = "lora_peft"
OPEN_CLIP_TARGETS = ("attn", "c_fc", "c_proj")
TIMM_VIT_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
LORA_KEYS = ("r", "alpha", "dropout", "target_modules", "towers", "trainable")


@dataclass(frozen=True)
class Tower:
    """A part of a model LoRA may adapt: its module-name prefix and its default targets."""

    prefix: str
    default_targets: tuple[str, ...]


@dataclass(frozen=True)
class LoraSpec:
    """``model.lora`` after validation (see the module docstring for each key)."""

    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: Optional[tuple[str, ...]] = None
    towers: Optional[tuple[str, ...]] = None
    trainable: Optional[tuple[str, ...]] = None


def parse_lora(config: Mapping[str, Any], towers: Sequence[str]) -> LoraSpec:
    """Validate ``model.lora``.

    Args:
        config: the mapping from the config (``r``, ``alpha``, ``dropout``, ``target_modules``,
            ``towers``, ``trainable``; all optional).
        towers: the tower names this model has (CLIP: ``image``, ``text``).

    Returns:
        The spec.

    Raises:
        ValueError: an unknown key, a rank below 1, a dropout outside [0, 1), an unknown tower.
    """
    unknown = sorted(set(config) - set(LORA_KEYS))
    if unknown:
        raise ValueError(f"model.lora: unknown keys {unknown}; the keys are {list(LORA_KEYS)}")
    def as_tuple(v: Any) -> Optional[tuple]:
        return None if v is None else ((v,) if isinstance(v, str) else tuple(v))

    spec = LoraSpec(r=int(config.get("r", 8)), alpha=float(config.get("alpha", config.get("r", 8))),
                    dropout=float(config.get("dropout", 0.0)), target_modules=as_tuple(config.get("target_modules")),
                    towers=as_tuple(config.get("towers")), trainable=as_tuple(config.get("trainable")))
    if spec.r < 1:
        raise ValueError(f"model.lora.r must be >= 1, got {spec.r}")
    if not 0.0 <= spec.dropout < 1.0:
        raise ValueError(f"model.lora.dropout must be in [0, 1), got {spec.dropout}")
    wrong = sorted(set(spec.towers or ()) - set(towers))
    if wrong:
        raise ValueError(f"model.lora.towers: {wrong} are not towers of this model; choose from {list(towers)}")
    return spec


def adaptable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The layers peft's LoRA adapts here: ``nn.Linear`` and ``nn.MultiheadAttention``.

    The ``out_proj`` of a ``MultiheadAttention`` is left out: torch's attention reads its weight
    without calling it, so an adapter there would be ignored (peft's ``MultiheadAttention``
    docstring); adapting the attention adapts it.
    """
    inside_attention = {f"{name}.out_proj" for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.MultiheadAttention)) and name not in inside_attention}


def _matches(name: str, pattern: str) -> bool:
    """A module-name suffix (``c_fc``, ``attn.qkv``) or an ``fnmatch`` glob on the whole name."""
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def _suffixes(names: Sequence[str]) -> list[str]:
    """Short names of candidates for a refusal: the last two name parts, digits dropped."""
    out = {".".join(p for p in n.split(".")[-2:] if not p.isdigit()) for n in names}
    return sorted(out)


def resolve_targets(model: nn.Module, spec: LoraSpec, towers: Mapping[str, Tower]) -> list[str]:
    """The full names of the modules to adapt.

    Args:
        model: the model (open_clip CLIP or timm ViT).
        spec: the validated ``model.lora``.
        towers: the model's towers by name; ``spec.towers`` selects among them (default: all).

    Returns:
        Module names, each a ``nn.Linear`` or ``nn.MultiheadAttention``.

    Raises:
        ValueError: a ``target_modules`` entry (or a tower's default) that matches no layer,
            naming the candidates.
    """
    chosen = [towers[t] for t in (spec.towers or tuple(towers))]
    candidates = list(adaptable_modules(model))

    def hits(tower: Tower, pattern: str) -> list[str]:
        return [n for n in candidates if n.startswith(tower.prefix)
                and (_matches(n[len(tower.prefix):], pattern) or _matches(n, pattern))]

    targets: list[str] = []
    if spec.target_modules is None:
        for tower in chosen:
            for pattern in tower.default_targets:
                found = hits(tower, pattern)
                if not found:
                    inside = [n for n in candidates if n.startswith(tower.prefix)]
                    raise ValueError(
                        f"model.lora: the default target {pattern!r} matches no layer under "
                        f"{tower.prefix!r}; set model.lora.target_modules, candidates: {_suffixes(inside)}"
                    )
                targets += found
    else:
        for pattern in spec.target_modules:  # each adapts something in one of the chosen towers
            found = [n for tower in chosen for n in hits(tower, pattern)]
            if not found:
                inside = [n for n in candidates if any(n.startswith(t.prefix) for t in chosen)]
                raise ValueError(f"model.lora.target_modules: {pattern!r} matches no Linear or MultiheadAttention "
                                 f"layer of the chosen towers; candidates: {_suffixes(inside)}")
            targets += found
    return list(dict.fromkeys(targets))


def inject_lora(model: nn.Module, spec: LoraSpec, towers: Mapping[str, Tower],
                default_trainable: Sequence[str]) -> list[str]:
    """Freeze ``model``, add peft LoRA adapters, unfreeze the ``trainable`` parameters.

    Args:
        model: the model, modified in place.
        spec: the validated ``model.lora``.
        towers: see :func:`resolve_targets`.
        default_trainable: parameter-name globs trained beside the adapters when
            ``spec.trainable`` is unset.

    Returns:
        The adapted module names.
    """
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:
        raise ImportError("model.lora needs Hugging Face peft: pip install -e '.[lora]'") from err
    targets = resolve_targets(model, spec, towers)
    # A regex string is matched against whole module names by peft (re.fullmatch): exactly these.
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules="|".join(re.escape(t) for t in targets))
    inject_adapter_in_model(config, model)  # marks only the adapters trainable
    globs = spec.trainable if spec.trainable is not None else tuple(default_trainable)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.requires_grad_(True)
        elif any(fnmatch.fnmatchcase(name, g) for g in globs):
            param.requires_grad_(True)
    return targets


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its layer's weights and put the plain layer back (in place).

    After this the model has the names and types it was built with (no peft module left), and
    computes what the adapted model computed. Uses peft's per-layer ``merge`` /
    ``unload_and_optionally_merge_module`` with ``safe_merge`` (a NaN in the merge is refused).

    Returns:
        ``model``.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    done: list[str] = []
    for name, layer in layers:
        if any(name.startswith(d + ".") for d in done):
            continue  # inside a layer already unloaded (an attention's out_proj)
        if hasattr(layer, "unload_and_optionally_merge_module"):  # peft's MultiheadAttention
            base = layer.unload_and_optionally_merge_module(merge=True, safe_merge=True, adapter_names=None)
        else:
            layer.merge(safe_merge=True)
            base = layer.get_base_layer()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, base)
        done.append(name)
    return model


def out_proj_applications(version: str) -> int:
    """How many times peft ``version``'s LoRA on a ``nn.MultiheadAttention`` applies ``out_proj``'s
    update in the forward and in ``merge``: 2 before 0.22 (W + 2 dW, huggingface/peft PR #3774), then 1."""
    from packaging.version import Version

    return 2 if Version(version).release < (0, 22) else 1


def installed_peft() -> str:
    """The installed peft's version (the ``lora`` extra)."""
    import peft

    return peft.__version__


def mha_out_proj_lora_b(module: nn.Module) -> list[str]:
    """State-dict names of the ``lora_B`` tensors of every LoRA-adapted ``nn.MultiheadAttention``'s
    ``out_proj`` in ``module`` (the tensors whose meaning changed with peft 0.22)."""
    from peft.tuners.lora.layer import MultiheadAttention as LoraMHA

    return [f"{name}.base_layer.out_proj.{p}" for name, m in module.named_modules() if isinstance(m, LoraMHA)
            for p, _ in m.base_layer.out_proj.named_parameters() if p.startswith("lora_B.")]


def match_installed_peft(module: nn.Module, checkpoint: dict[str, Any], where: str,
                         installed: Optional[str] = None) -> None:
    """Convert a LoRA checkpoint's adapters, in place, for the installed peft (``installed``: for tests).

    peft before 0.22 applied a ``nn.MultiheadAttention``'s ``out_proj`` update twice, 0.22 once,
    so ``out_proj``'s ``lora_B`` (the update is linear in it) is scaled by recorded / installed
    applications in every weight entry of ``checkpoint`` that holds it (``state_dict``, an EMA's
    averaged and raw weights). A checkpoint without ``lora_peft`` was written before mmssl recorded
    it, when the ``lora`` extra held peft below 0.22: it counts as 2. The checkpoint then records
    the installed peft, so a second call changes nothing. Warns once, naming ``where``, when it scales.
    """
    if not checkpoint.get(LORA_BASE):
        return
    installed = installed or installed_peft()
    recorded = checkpoint.get(LORA_PEFT)
    factor = (out_proj_applications(recorded) if recorded else 2) / out_proj_applications(installed)
    if factor != 1:
        names = mha_out_proj_lora_b(module)
        for entry in checkpoint.values():
            if isinstance(entry, dict):
                for name in names:
                    if isinstance(entry.get(name), torch.Tensor):
                        entry[name] = entry[name] * factor
        if names:
            import warnings

            now = out_proj_applications(installed)
            warnings.warn(f"{where}: LoRA adapters trained under peft {recorded or 'below 0.22 (not recorded)'}, "
                          f"which applied a MultiheadAttention's out_proj update {int(factor * now)} time(s); "
                          f"peft {installed} applies it {now}: out_proj's lora_B scaled by {factor:g} so the model "
                          "computes what it trained as", stacklevel=2)
    checkpoint[LORA_PEFT] = installed


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` holds peft adapters."""
    return any("lora_A" in name for name, _ in model.named_parameters())


# ---- the base: files and checksums ---------------------------------------------------------------


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def base_reference(files: Mapping[str, Optional[str]]) -> dict[str, dict[str, str]]:
    """``{argument: {"path": absolute path, "sha256": ...}}`` of the base files that are set."""
    return {arg: {"path": os.path.abspath(p), "sha256": sha256_file(p)} for arg, p in files.items() if p}


def check_base(reference: Mapping[str, Mapping[str, str]], where: str) -> dict[str, str]:
    """The base files of a LoRA checkpoint, each checked against its recorded checksum.

    Args:
        reference: the checkpoint's ``lora_base``.
        where: the checkpoint file, named in errors.

    Returns:
        ``{argument: path}`` to rebuild the base with.

    Raises:
        FileNotFoundError: a base file is missing.
        ValueError: a base file's checksum differs from the recorded one.
    """
    out = {}
    for arg, ref in reference.items():
        path = ref["path"]
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{where}: the LoRA base file {path} (model.{arg}) is missing; the checkpoint "
                                    "holds only the adapters and needs the file it was trained on")
        digest = sha256_file(path)
        if digest != ref["sha256"]:
            raise ValueError(f"{where}: the LoRA base file {path} (model.{arg}) has changed since training "
                             f"(sha256 {digest[:12]}..., recorded {ref['sha256'][:12]}...)")
        out[arg] = path
    return out


def trainable_keys(module: nn.Module) -> list[str]:
    """Names of ``module``'s trainable parameters (what a LoRA checkpoint holds)."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


def load_trained_state(module: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Load a LoRA checkpoint's trained tensors into a module whose base is already loaded.

    Raises:
        KeyError: the checkpoint lacks a trainable tensor of the module, or holds one the module
            has not (another ``model.lora``), naming the first.
    """
    own = set(trainable_keys(module))
    missing, extra = sorted(own - set(state)), sorted(set(state) - set(module.state_dict()))
    if missing or extra:
        raise KeyError(f"{where}: the LoRA checkpoint does not fit the model its hyper-parameters build: "
                       f"missing {missing[:3]}, unexpected {extra[:3]}")
    module.load_state_dict(dict(state), strict=False)


class LoraCheckpoint:
    """Checkpoint hooks of a LightningModule that may hold LoRA adapters (mixed in first).

    With adapters (``self.lora_base`` set by :func:`enable_lora`) a checkpoint keeps only the
    trainable tensors and the base reference; a resume (``ckpt_path``) checks the base the run
    rebuilt from its config against that reference and loads the trainable tensors only.
    """

    lora_base: Optional[dict[str, dict[str, str]]] = None

    def sharding_refusal(self) -> Optional[str]:
        """Why this model cannot be sharded with FSDP2, or ``None`` (``mmssl.sharding``)."""
        if self.lora_base:
            # peft's LoRA on nn.MultiheadAttention (open_clip's towers) hands the adapted weight to
            # the attention outside the block's module tree, which fully_shard refuses ("Some
            # parameters are not in the module tree"); LoRA trains few parameters: DDP fits it.
            return ("model.init_args.lora: LoRA adapters are not sharded by FSDP2 in mmssl; train LoRA with DDP "
                    "(configs/trainer/ddp.yaml, ddp_cpu.yaml)")
        return None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        if self.lora_base:
            keep = set(trainable_keys(self))  # type: ignore[arg-type]
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
            checkpoint[LORA_BASE] = self.lora_base
            checkpoint[LORA_PEFT] = installed_peft()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        if self.lora_base:
            recorded = checkpoint.get(LORA_BASE) or {}
            ours = {a: r["sha256"] for a, r in self.lora_base.items()}
            if {a: r.get("sha256") for a, r in recorded.items()} != ours:
                raise ValueError(f"resuming a LoRA run on another base: the checkpoint was trained on {recorded}, "
                                 f"this run's base files are {self.lora_base}")
            # Before the weights and an EMA's average are loaded (the module's hook runs first).
            match_installed_peft(self, checkpoint, "the resumed checkpoint")  # type: ignore[arg-type]
            own = set(trainable_keys(self))  # type: ignore[arg-type]
            missing = sorted(own - set(checkpoint["state_dict"]))
            if missing:
                raise KeyError(f"the LoRA checkpoint lacks trainable tensors {missing[:3]}")


def enable_lora(module: nn.Module, config: Optional[Mapping[str, Any]], towers: Mapping[str, Tower],
                base_files: Mapping[str, Optional[str]], required: str,
                default_trainable: Sequence[str]) -> Optional[LoraSpec]:
    """Apply ``model.lora`` to ``module.model`` (a no-op for ``None``).

    Args:
        module: the LightningModule (a :class:`LoraCheckpoint`); its ``model`` is adapted.
        config: ``model.lora``.
        towers: the towers of ``module.model`` (see :func:`resolve_targets`).
        base_files: the module's base-file arguments and their values.
        required: the base-file argument that must be set (a random base has no file to rebuild from).
        default_trainable: see :func:`inject_lora`.

    Returns:
        The spec, or ``None`` without LoRA.
    """
    if config is None:
        return None
    spec = parse_lora(config, list(towers))
    if not base_files.get(required):
        raise ValueError(f"model.lora needs model.{required}: a LoRA checkpoint holds only the adapters and "
                         "names the pretrained file it adapts")
    inject_lora(module.model, spec, towers, default_trainable)
    module.lora_base = base_reference(base_files)
    module.strict_loading = False  # resumes load the trainable tensors only (checked in on_load_checkpoint)
    return spec


def clip_towers(model: nn.Module) -> dict[str, Tower]:
    """The towers of an open_clip model: ``image`` (``visual.``; a timm trunk's layers under
    ``visual.trunk.``) and ``text`` (the open_clip text transformer at the top level, or ``text.``)."""
    timm_trunk = type(model.visual).__name__ == "TimmModel"
    image = Tower("visual.trunk." if timm_trunk else "visual.", TIMM_VIT_TARGETS if timm_trunk else OPEN_CLIP_TARGETS)
    text = Tower("text." if hasattr(model, "text") else "transformer.", OPEN_CLIP_TARGETS)
    return {"image": image, "text": text}


TIMM_TOWERS: dict[str, Tower] = {"image": Tower("", TIMM_VIT_TARGETS)}
CLIP_TRAINABLE = ("logit_scale", "logit_bias")
CLASSIFIER_TRAINABLE = ("head.*", "fc_norm.*")

__all__ = ["CLASSIFIER_TRAINABLE", "CLIP_TRAINABLE", "LORA_BASE", "LORA_PEFT", "LoraCheckpoint", "LoraSpec",
           "TIMM_TOWERS", "Tower", "adaptable_modules", "base_reference", "check_base", "clip_towers",
           "enable_lora", "has_lora", "inject_lora", "installed_peft", "load_trained_state", "match_installed_peft",
           "merge_lora", "mha_out_proj_lora_b", "out_proj_applications", "parse_lora", "resolve_targets",
           "sha256_file", "trainable_keys"]

