"""Config keys that moved: saved ``config.yaml`` files and checkpoints keep loading under the new names.

A class lists the init arguments it renamed or moved into a config group as ``renamed_args``,
``{old: new}``, where ``new`` is a name or ``group.key`` (``{"image_mask_ratio": "flip.mask_ratio"}``).
:func:`upgrade_init_args` rewrites a mapping of init arguments (a checkpoint's ``hyper_parameters``,
the ``init_args`` of a config) with a deprecation warning that names where the old keys came from;
:func:`upgrade_config` does the same for every ``class_path`` / ``init_args`` node of a parsed YAML
config, so an old run's ``config.yaml`` runs unchanged (``mmssl validate --config run/config.yaml``).
A group the CLI adds for a class of its own (``add_lightning_class_args``: ``nonfinite_guard``)
names no ``class_path``; its renames are passed by the group's key (``sections``).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from typing import Any, Iterable, Mapping, Optional

from mmssl.errors import ConfigError


def renamed_args(cls: type) -> dict[str, str]:
    """``{old: new}`` of ``cls`` and its bases (a subclass's entry wins)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        out.update(getattr(klass, "renamed_args", None) or {})
    return out


def move_keys(init_args: Mapping[str, Any], renames: Mapping[str, str], where: str) -> tuple[dict[str, Any], list[str]]:
    """``init_args`` with each old key of ``renames`` moved to its new place.

    Args:
        init_args: the arguments as written (left unchanged).
        renames: ``{old: new}``, ``new`` a name or ``group.key``.
        where: the file or key the arguments came from, named in errors.

    Returns:
        The rewritten arguments and the ``old -> new`` moves made.

    Raises:
        ConfigError: an old key and its new place both given, with different values (a ``ValueError``).
    """
    out = dict(init_args)
    moves = []
    for old, new in renames.items():
        if old not in out:
            continue
        value = out.pop(old)
        group, _, key = new.partition(".")
        target = out if not key else _group(out, group)
        name = key or group
        if name in target and target[name] != value:
            raise ConfigError(f"{where}: {old!r} (the old name of {new!r}) is {value!r} but {new!r} is "
                             f"{target[name]!r}: keep only {new!r}")
        target[name] = value
        moves.append(f"{old} -> {new}")
    return out, moves


def _group(args: dict[str, Any], group: str) -> dict[str, Any]:
    """The dict of config group ``group`` in ``args``, made a plain dict in place."""
    value = args.get(group)
    if value is None:
        value = {}
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, Mapping):
        value = dict(value)
    else:
        raise ValueError(f"config group {group!r} must be a mapping, got {value!r}")
    args[group] = value
    return value


def warn_moves(moves: Iterable[str], where: str) -> None:
    moves = list(moves)
    if moves:
        warnings.warn(f"{where}: renamed config keys read under their new names ({', '.join(moves)}); "
                      "write the new names, the old ones will be removed", FutureWarning, stacklevel=3)


def upgrade_init_args(cls: type, init_args: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``cls``'s init arguments with its renamed keys moved (a warning names ``where`` and each move)."""
    out, moves = move_keys(init_args, renamed_args(cls), where)
    warn_moves(moves, where)
    return out


def _class_of(class_path: Any) -> Optional[type]:
    """The class a config's ``class_path`` names, for mmssl's own classes only (others never renamed)."""
    if not isinstance(class_path, str) or not class_path.startswith("mmssl."):
        return None
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None  # LightningCLI reports the bad class path itself


def upgrade_config(config: Any, where: str, model_renames: Mapping[str, str] = (),
                   sections: Mapping[str, Mapping[str, str]] = {}) -> tuple[Any, list[str]]:
    """A parsed YAML config with every mmssl class's renamed init arguments moved.

    Args:
        config: the parsed config (dicts, lists, values).
        where: the file, named in messages.
        model_renames: the renames for a ``model`` node that names no ``class_path`` (its class comes
            from another config file or the command line): the union of the model classes' own.
        sections: ``{key: renames}`` for the groups named ``key`` that name no ``class_path`` (the
            CLI's own callbacks, ``nonfinite_guard``).

    Returns:
        The rewritten config (a new object where anything moved) and the moves made.
    """
    moves: list[str] = []

    def visit(node: Any, key: Optional[str]) -> Any:
        if isinstance(node, list):
            return [visit(item, None) for item in node]
        if not isinstance(node, dict):
            return node
        node = {k: visit(v, k) for k, v in node.items()}
        cls = _class_of(node.get("class_path"))
        if cls is not None:
            renames = renamed_args(cls)
        else:
            renames = model_renames if key == "model" else sections.get(key, {})
        if not renames:
            return node
        if "init_args" in node or "class_path" in node:
            init_args, moved = move_keys(node.get("init_args") or {}, renames, where)
            if moved:
                node["init_args"] = init_args
        else:  # a model section written as its init arguments alone
            node, moved = move_keys(node, renames, where)
        moves.extend(moved)
        return node

    return visit(config, None), moves


def model_renames(class_paths: Iterable[str]) -> dict[str, str]:
    """The union of the renames of the model classes at ``class_paths`` (for a config or flag that
    names no class: every class that renamed a key renamed it alike)."""
    out: dict[str, str] = {}
    for path in class_paths:
        cls = _class_of(path)
        if cls is not None:
            out.update(renamed_args(cls))
    return out


def model_class_path(args: list[str], read_yaml: Any) -> Optional[str]:
    """The class the command line's model is, as LightningCLI will read it: the last of each
    ``--config`` file's ``model`` (its ``class_path``, or a class name), ``--model CLASS`` and
    ``--model.class_path CLASS``; ``None`` where none names one."""
    found: Optional[str] = None
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if not eq and i + 1 < len(args) and flag in ("--config", "-c", "--model", "--model.class_path"):
            value, i = args[i + 1], i + 1
        elif not eq:
            flag = ""
        i += 1
        if flag in ("--config", "-c"):
            config = read_yaml(value)
            model = config.get("model") if isinstance(config, dict) else None
            found = _named_class(model) or found
        elif flag == "--model":
            config = read_yaml(value)  # a class name, or a file of the model's section
            found = _named_class(config if config is not None else value) or found
        elif flag == "--model.class_path":
            found = value or found
    return found


def _named_class(model: Any) -> Optional[str]:
    """The class a ``model`` section (a class name, or a mapping with ``class_path``) names, if any."""
    if isinstance(model, dict):
        model = model.get("class_path")
    return model if isinstance(model, str) and model.replace(".", "").replace("_", "").isalnum() else None


def _renames_of(class_path: Optional[str], fallback: Mapping[str, str]) -> Mapping[str, str]:
    """The renames of the class at ``class_path`` (a dotted path or a short name, ``M3AE``);
    ``fallback`` where no class is named or the name is not found."""
    if class_path is None:
        return fallback
    candidates = [class_path] if "." in class_path else [f"mmssl.models.{class_path.lower()}.{class_path}",
                                                         f"mmssl.models.{class_path}"]
    for path in candidates:
        cls = _class_of(path)
        if isinstance(cls, type):
            return renamed_args(cls)
    return {} if "." in class_path else fallback


def upgrade_command_line(args: list[str], renames_for_models: Mapping[str, str],
                         read_yaml: Any, dump_yaml: Any, sections: Mapping[str, Mapping[str, str]] = {}) -> list[str]:
    """A LightningCLI command line with renamed keys moved: in each ``--config`` file (passed on
    as the rewritten YAML text when anything moved), in ``--model.[init_args.]<old>`` flags and in
    ``--<section>.<old>`` flags.

    The model's keys move by the renames of the model's own class (:func:`model_class_path`), so a
    key that another class renamed stays as written (M3AE's ``image_mask_ratio`` is its own, not
    CLIP's ``flip.mask_ratio``). Where the command line names no class, or a short name that is
    not an mmssl model's, ``renames_for_models`` applies.

    Args:
        args: the command line without the program name.
        renames_for_models: :func:`model_renames` of the model classes, for a model of no known class.
        read_yaml: ``path -> parsed config`` (``None`` for a value that is no readable file).
        dump_yaml: ``config -> YAML text``.
        sections: ``{key: renames}`` of the CLI's own groups (:func:`upgrade_config`).
    """
    renames_for_models = _renames_of(model_class_path(args, read_yaml), renames_for_models)
    out, moves = [], []
    config_next = False
    for arg in args:
        if config_next or arg.startswith("--config="):
            value = arg if config_next else arg.split("=", 1)[1]
            config = read_yaml(value)
            if config is not None:
                config, moved = upgrade_config(config, value, renames_for_models, sections)
                if moved:
                    warn_moves(moved, value)
                    value = dump_yaml(config)
            arg = value if config_next else f"--config={value}"
            config_next = False
        elif arg in ("--config", "-c"):
            config_next = True
        elif arg.startswith("--model."):
            flag, eq, value = arg.partition("=")
            key = flag[len("--model."):]
            key = key[len("init_args."):] if key.startswith("init_args.") else key
            if key in renames_for_models:
                moves.append(f"{flag} -> --model.init_args.{renames_for_models[key]}")
                arg = f"--model.init_args.{renames_for_models[key]}{eq}{value}"
        elif arg.startswith("--") and "." in arg:
            flag, eq, value = arg.partition("=")
            section, _, key = flag[2:].partition(".")
            if key in sections.get(section, {}):
                new = f"--{section}.{sections[section][key]}"
                moves.append(f"{flag} -> {new}")
                arg = f"{new}{eq}{value}"
        out.append(arg)
    warn_moves(moves, "the command line")
    return out
