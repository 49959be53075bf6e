"""What ``mmssl SUBCOMMAND`` runs: LightningCLI's runs, the shipped recipes, or a tool.

``fit | validate | test | predict`` go on to LightningCLI (:func:`mmssl.cli.cli_main`), each
``--config`` first resolved against the recipes shipped in the package (``demo/clip`` names
``configs/demo/clip.yaml`` from any folder; a file of that path in the working folder wins, and the
command says which it took). ``configs`` lists the recipes and copies one out. Every other
subcommand is a tool, ``tools/X.py`` of a clone, shipped as ``mmssl.tools.X``: ``mmssl export``,
``mmssl probe`` (``linear_probe``), ``mmssl zero-shot``..., with the tool's own arguments.

LitGPT's shape (``litgpt pretrain | finetune | evaluate | convert``, configs shipped in the package
and named on the command line). Imports no torch: ``mmssl --help`` and a tool's ``--help`` stay fast;
this module is imported by ``mmssl.entry`` (the console script) and ``mmssl.cli`` only, and imports a
tool only to run it.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import os
import pkgutil
import shutil
import sys
from pathlib import Path
from typing import NoReturn, Optional

import mmssl

RUNS = {
    "fit": "train a model from a recipe (--ckpt_path last resumes)",
    "validate": "run the validation loop once on a checkpoint",
    "test": "run the test loop once on a checkpoint",
    "predict": "run prediction on a checkpoint",
}
# A tool's subcommand is its file name with hyphens, except where a shorter word is the one users say.
TOOL_NAMES = {"linear_probe": "probe"}
RECIPE_SUFFIXES = (".yaml", ".yml")


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"mmssl: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _is_rank_zero() -> bool:
    # Lightning's launchers re-run the command on every rank: say things once.
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def configs_root() -> Path:
    """The folder of the shipped recipes and model configs.

    A wheel installs the repository's ``configs/`` as ``mmssl/configs``; a clone (an editable
    install, or ``mmssl`` on ``sys.path``) has it beside the package.
    """
    package = Path(mmssl.__file__).resolve().parent
    if (package / "configs").is_dir():
        return package / "configs"
    clone = package.parent
    if (clone / "configs").is_dir() and (clone / "pyproject.toml").is_file():
        return clone / "configs"
    raise FileNotFoundError(f"mmssl: no shipped configs beside {package} (a broken install: reinstall mmssl)")


def _installed_layout() -> bool:
    """Whether configs/ lies inside the package (a wheel), where ``configs/models/x.json`` relative
    to the working folder's parent no longer names the shipped file."""
    return configs_root().parent == Path(mmssl.__file__).resolve().parent


def recipe_names() -> list[str]:
    """Every shipped recipe, folder-relative and without ``.yaml`` (``demo/clip``), sorted."""
    root = configs_root()
    return sorted(p.relative_to(root).with_suffix("").as_posix()
                  for p in root.rglob("*") if p.suffix in RECIPE_SUFFIXES and p.is_file())


def shipped_file(name: str, suffixes: tuple[str, ...] = RECIPE_SUFFIXES) -> Optional[Path]:
    """The shipped file ``name`` names (``demo/clip``, ``demo/clip.yaml``, ``configs/demo/clip.yaml``,
    ``models/clip_tiny.json``), or None."""
    root = configs_root()
    rel = name.replace("\\", "/")
    while rel.startswith("./"):
        rel = rel[2:]
    if rel.startswith("configs/"):  # the clone's spelling, as the docs write it
        rel = rel[len("configs/"):]
    if not rel or os.path.isabs(rel):
        return None
    for candidate in (rel, *(rel + s for s in suffixes)):
        path = (root / candidate).resolve()
        if path.is_file() and path.is_relative_to(root.resolve()) and path.suffix in (*suffixes, ".json"):
            return path
    return None


def closest_recipes(name: str, n: int = 4) -> list[str]:
    """The shipped recipes whose names are nearest ``name`` (difflib), best first."""
    names = recipe_names()
    key = Path(name.replace("\\", "/").removeprefix("configs/")).with_suffix("").as_posix()
    # The recipes of that file name in any folder first ("vit_b32": clip/vit_b32, coca/vit_b32).
    found = [r for r in names if r.rsplit("/", 1)[-1] == key.rsplit("/", 1)[-1]]
    found += [r for r in difflib.get_close_matches(key, names, n=n, cutoff=0.4) if r not in found]
    return found[:n]


def resolve_config(value: str) -> tuple[str, Optional[str]]:
    """The file ``--config value`` reads, and a line saying so where it is not the given path.

    A path that exists wins (the line names it where a shipped recipe has the same name); else a
    shipped recipe of that name. Raises SystemExit naming the closest recipes when neither exists.
    An inline YAML or JSON config, or a URL, is left to jsonargparse.
    """
    if "\n" in value or value.lstrip()[:1] in ("{", "[") or "://" in value:
        return value, None
    shipped = shipped_file(value)
    if os.path.exists(value):
        if shipped is not None and not os.path.samefile(value, shipped):
            return value, f"--config {value}: your file {os.path.abspath(value)}, not the shipped recipe {shipped}"
        return value, None
    if shipped is not None:
        return str(shipped), f"--config {value}: the shipped recipe {shipped}"
    closest = closest_recipes(value)
    hint = f"; the closest: {', '.join(closest)}" if closest else ""
    _fail(f"--config {value}: no such file here, nor a shipped recipe of that name{hint} "
          "(`mmssl configs` lists them all)")


def _shipped_model_json(name: object) -> Optional[str]:
    """A recipe's relative ``model_name`` JSON (``configs/models/clip_tiny.json``) as the shipped
    file, where it is not in the working folder and the package holds configs/ (a wheel: the
    model reads such a path relative to the working folder or a clone's root only)."""
    if not (isinstance(name, str) and name.endswith(".json")) or os.path.isabs(name) or os.path.exists(name):
        return None
    if not _installed_layout():
        return None
    found = shipped_file(name, suffixes=())
    return str(found) if found is not None else None


def read_config(path: str, option: str = "--config") -> object:
    """A ``--config`` file's YAML (or another YAML file the command line names, ``option``'s),
    refusing a key written twice in one mapping (PyYAML, and so jsonargparse, keeps the last
    silently: an edited copy of a recipe that adds ``max_steps`` below the one it has would run with
    either, unseen).

    Raises:
        OSError, yaml.YAMLError: the file does not read (jsonargparse reports it, naming the file).
        SystemExit: a duplicate key, in one line naming the file, the key and both lines.
    """
    import yaml  # jsonargparse's own dependency; only for the runs

    with open(path, encoding="utf-8") as f:
        loader = yaml.SafeLoader(f)
        try:
            # The raw node tree, before PyYAML builds it: building flattens a merge ("<<: *base")
            # into the mapping that holds it, so a merged key and the one written beside it to
            # override it would read as one key written twice.
            node = loader.get_single_node()
            if node is None:
                return None
            _refuse_duplicate_keys(node, loader, f"{option} {path}")
            loader.constructed_objects = {}  # the keys built to compare them: build afresh
            return loader.construct_document(node)
        finally:
            loader.dispose()


def _refuse_duplicate_keys(root: object, loader: object, where: str) -> None:
    """Exit (:func:`_fail`) naming ``where``, the key and both lines if a mapping of the node tree
    ``root`` (``yaml.compose``'s) holds a scalar key twice; merge keys (``<<``) are skipped. Each
    mapping is walked once (an alias shares its anchor's node)."""
    import yaml

    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(reversed(node.value))  # in the file's order: the first duplicate is reported
        elif isinstance(node, yaml.MappingNode):
            stack.extend(child for pair in reversed(node.value) for child in reversed(pair))
            lines: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue  # "<<: *base": keys written beside a merge override it, as YAML means
                key = loader.construct_object(key_node)  # 1 and 1.0, as the dict built would
                line = key_node.start_mark.line + 1
                try:
                    if key in lines:
                        _fail(f"{where}: key {key!r} is written twice in one mapping (lines {lines[key]} "
                              f"and {line}); keep one")
                    lines[key] = line
                except TypeError:  # an unhashable key: PyYAML refuses it itself
                    pass


def _check_yaml_value(option: str, value: str) -> None:
    """A YAML file given as an option's value (``--trainer t.yaml``, ``--model m.yaml``) read as
    :func:`read_config` reads a ``--config`` file: a key written twice is refused."""
    import yaml

    if option.startswith("-") and value.endswith((".yaml", ".yml")) and os.path.isfile(value):
        try:
            read_config(value, option)
        except (OSError, yaml.YAMLError):
            pass  # jsonargparse reports it, naming the file


def _recipe_model_name(path: str) -> object:
    import yaml

    try:
        config = read_config(path)
    except (OSError, yaml.YAMLError):
        return None  # jsonargparse reports it, naming the file
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        return None
    init_args = model.get("init_args")
    return (init_args if isinstance(init_args, dict) else model).get("model_name")


def resolve_run_arguments(argv: list[str]) -> list[str]:
    """``argv`` of a LightningCLI run with each ``--config`` resolved (:func:`resolve_config`) and,
    in a wheel, each relative model JSON a recipe or ``--model...model_name`` names that is not in
    the working folder pointed at the shipped one. Says on stderr which recipe each name took."""
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        option, value, step = None, None, 1
        if token in ("--config", "-c") and i + 1 < len(argv):
            option, value, step = token, argv[i + 1], 2
        elif token.startswith("--config="):
            option, value = "--config", token.split("=", 1)[1]
        if option is None:
            key, _, inline = token.partition("=")
            if key in ("--model.model_name", "--model.init_args.model_name"):
                if not inline and i + 1 < len(argv):
                    shipped = _shipped_model_json(argv[i + 1])
                    out += [token, shipped or argv[i + 1]]
                    i += 2
                    continue
                token = f"{key}={_shipped_model_json(inline) or inline}"
            _check_yaml_value(key, inline or (argv[i + 1] if i + 1 < len(argv) else ""))
            out.append(token)
            i += 1
            continue
        path, note = resolve_config(value)
        if note:
            notes.append(note)
        out += [option, path] if step == 2 else [f"--config={path}"]
        shipped_json = _shipped_model_json(_recipe_model_name(path)) if os.path.isfile(path) else None
        if shipped_json:
            # Right after its recipe: a later --config or override still wins, as it would over the recipe.
            out.append(f"--model.init_args.model_name={shipped_json}")
        i += step
    if _is_rank_zero():
        for note in notes:
            print(f"mmssl: {note}", file=sys.stderr, flush=True)
    return out


def tools() -> dict[str, str]:
    """Subcommand -> module name (``export`` -> ``export``, ``probe`` -> ``linear_probe``) of every tool."""
    import mmssl.tools

    names = [m.name for m in pkgutil.iter_modules(mmssl.tools.__path__) if not m.name.startswith("_")]
    return dict(sorted((TOOL_NAMES.get(name, name.replace("_", "-")), name) for name in names))


def _tool_summary(module: str) -> str:
    """The first line of a tool's docstring, read without importing it (``mmssl --help`` stays fast)."""
    import mmssl.tools

    for folder in mmssl.tools.__path__:
        path = Path(folder) / f"{module}.py"
        if path.is_file():
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            return _one_line(doc)
    return ""


def _one_line(text: str, width: int = 78) -> str:
    line = " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""
    if len(line) > width:
        line = line[:width].rsplit(" ", 1)[0] + " ..."
    return line.rstrip(":,")


def overview() -> str:
    """``mmssl --help``: every subcommand with one line."""
    table = tools()
    width = max(len(n) for n in [*RUNS, "configs", *table]) + 2
    lines = [
        "usage: mmssl SUBCOMMAND [options]     (mmssl SUBCOMMAND --help: its options)",
        "",
        "Self-supervised MAE, CLIP and CoCa pretraining on Lightning, timm and open_clip.",
        "",
        "runs (LightningCLI; --config takes a file or a shipped recipe's name, e.g. demo/clip):",
        *(f"  {name:<{width}}{text}" for name, text in RUNS.items()),
        "",
        "recipes:",
        f"  {'configs':<{width}}list the shipped recipes; --copy NAME DEST copies one out to edit",
        "",
        "tools (also python -m mmssl.tools.MODULE, and python tools/MODULE.py in a clone):",
        *(f"  {name:<{width}}{_tool_summary(module)}" for name, module in table.items()),
    ]
    return "\n".join(lines) + "\n"


def _recipe_summary(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    return _one_line(first.lstrip("#").strip(), width=70) if first.startswith("#") else ""


def configs_command(argv: list[str]) -> int:
    """``mmssl configs``: list the shipped recipes, or copy one out (``--copy NAME DEST``)."""
    parser = argparse.ArgumentParser(
        prog="mmssl configs", description="The recipes shipped with mmssl: `mmssl fit --config NAME` runs one.")
    parser.add_argument("--copy", nargs=2, metavar=("NAME", "DEST"),
                        help="copy recipe (or model JSON) NAME to DEST, a file or an existing folder, to edit")
    args = parser.parse_args(argv)
    root = configs_root()
    if args.copy:
        name, dest = args.copy
        source = shipped_file(name)
        if source is None:
            closest = closest_recipes(name)
            hint = f"; the closest: {', '.join(closest)}" if closest else ""
            _fail(f"configs --copy {name}: no shipped recipe or model config of that name{hint}", code=1)
        target = Path(dest) / source.name if os.path.isdir(dest) else Path(dest)
        if os.path.islink(target):  # a dangling link too: copying would write wherever it points
            _fail(f"configs --copy: {target} is a link (to {os.readlink(target)}); remove it or name another "
                  "destination", code=1)
        if target.exists():
            _fail(f"configs --copy: {target} exists; remove it or name another destination", code=1)
        if not target.parent.is_dir():
            _fail(f"configs --copy: {target.parent}: no such folder", code=1)
        try:
            # "x": created here or refused, never opened through a link or over a file made since the checks
            with open(source, "rb") as src, open(target, "xb") as dst:
                shutil.copyfileobj(src, dst)
        except FileExistsError:
            _fail(f"configs --copy: {target} exists; remove it or name another destination", code=1)
        print(f"{source} -> {target}")
        return 0
    names = recipe_names()
    width = max(len(n) for n in names) + 2
    print(f"Recipes shipped with mmssl ({root}); `mmssl fit --config NAME` runs one,")
    print("`mmssl configs --copy NAME DEST` copies one out to edit:")
    for name in names:
        print(f"  {name:<{width}}{_recipe_summary(shipped_file(name))}")
    models = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.json"))
    print(f"Model configs (model.init_args.model_name: configs/NAME): {', '.join(models)}")
    return 0


def run_tool(command: str, module: str, argv: list[str]) -> int:
    """Run tool ``module`` (``mmssl.tools.<module>``) with ``argv``; its exit status."""
    main = importlib.import_module(f"mmssl.tools.{module}").main
    program = sys.argv[0]
    sys.argv[0] = f"mmssl {command}"  # argparse's prog: usage lines read `mmssl export ...`
    try:
        return main(argv)
    finally:
        sys.argv[0] = program


def dispatch(args: Optional[list[str]] = None) -> Optional[list[str]]:
    """Run ``mmssl ARGS``'s tool or ``configs`` and exit with its status; or hand back a LightningCLI
    run's arguments with its ``--config`` names resolved (:func:`resolve_run_arguments`).

    Args:
        args: the command line after ``mmssl``; None: ``sys.argv[1:]``, then resolved in place and
            None returned, as LightningCLI warns when given ``args`` beside a command line (and
            Lightning's launchers re-run ``sys.argv`` on the other ranks).
    """
    argv = sys.argv[1:] if args is None else list(args)
    resolved = _dispatch(argv)
    if args is not None:
        return resolved
    sys.argv[1:] = resolved
    return None


def _dispatch(argv: list[str]) -> list[str]:
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(), end="", file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    command = argv[0]
    if command in RUNS or command.startswith("-"):
        return resolve_run_arguments(argv)
    if command == "configs":
        raise SystemExit(configs_command(argv[1:]))
    table = tools()
    aliases = {**{m: m for m in table.values()}, **{m.replace("_", "-"): m for m in table.values()}}
    module = table.get(command) or aliases.get(command)
    if module is None:
        valid = [*RUNS, "configs", *table]
        closest = difflib.get_close_matches(command, [*valid, *(a for a in aliases if a not in valid)], n=3)
        hint = f" (did you mean {' or '.join(closest)}?)" if closest else ""
        _fail(f"unknown subcommand {command!r}{hint}; valid: {', '.join(valid)} (mmssl --help)")
    name = next((n for n, m in table.items() if m == module), command)
    raise SystemExit(run_tool(name, module, argv[1:]))
