"""Every command and config block in README.md and docs/*.md resolves against the current code.

A renamed key, class or flag must fail here, not in a reader's first run:
- each ``mmssl fit|validate|test|predict ...`` (also through ``python -m mmssl``, ``torchrun -m
  mmssl`` and ``sbatch tools/slurm/train.sbatch``) runs in-process with ``--print_config``: the
  LightningCLI parses every key and class path against the signatures and exits, reading no data
  and no checkpoint, so a path that exists only on the reader's machine is no reason to fail;
- each ``python tools/X.py ...`` / ``python benchmarks/X.py ...`` goes through the tool's own
  argparse parser (its ``main`` is stopped right after parsing), and what ``tools/benchmark.py``
  passes on to mmssl after ``--`` is resolved as an mmssl command too;
- each ``yaml`` block that is an mmssl config is resolved stacked on a base recipe
  (``configs/demo/clip.yaml``, or the one the fence names: ```` ```yaml base=configs/X.yaml ````);
- relative links point at files that exist, and the README stays a ten-minute read.

Commands come from fenced code blocks (``bash``, ``console``, plain) and from inline code that
starts with ``mmssl <subcommand> --`` or ``python tools/``. In a block, ``\\`` continues a line,
``VAR=value`` sets a variable for the later lines, ``for X in A B; do`` binds X to A, and a
leading ``$ `` prompt, ``nice [-n N]``, ``env`` and ``VAR=value`` prefixes are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BASE_CONFIG = "configs/demo/clip.yaml"
SUBCOMMANDS = ("fit", "validate", "test", "predict")
# Top-level keys of `mmssl fit --print_config`: a YAML block whose keys are among these is a config.
CONFIG_KEYS = {"seed_everything", "trainer", "model", "data", "ckpt_path", "optimizer", "lr_scheduler",
               "summary", "nonfinite_guard", "evaluation_buffer_sync", "rng_state", "log_step_on_resume",
               "unfinished_epoch", "watchdog"}
FENCE = re.compile(r"^([ \t]*)```[ \t]*([^\n`]*)\n(.*?)^\1```[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`((?:mmssl (?:%s) --|python tools/)[^`]+)`" % "|".join(SUBCOMMANDS))
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Command:
    kind: str  # "mmssl" (argv after `mmssl`) or "tool" (script path + its argv)
    argv: tuple[str, ...]
    script: str = ""
    where: str = ""  # file:line of the first place it appears

    @property
    def key(self) -> tuple:
        return self.kind, self.script, self.argv


def _simple_commands(text: str) -> list[tuple[int, list[str]]]:
    """Shell text -> (line index, tokens) of each simple command, variables and for-loops resolved."""
    variables: dict[str, str] = {}
    commands = []
    logical: list[tuple[int, str]] = []  # lines joined at a trailing backslash
    for number, line in enumerate(text.splitlines()):
        if logical and logical[-1][1].endswith("\\"):
            logical[-1] = (logical[-1][0], logical[-1][1][:-1] + " " + line)
        else:
            logical.append((number, line))
    for number, line in logical:
        lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:  # an unbalanced quote: output in a console block, not a command
            continue
        current: list[str] = []
        redirect = False
        for token in [*tokens, ";"]:
            if redirect or re.fullmatch(r"\d?>>?(&\d)?", token):  # `> out.txt`, `2>&1`: not arguments
                redirect = re.fullmatch(r"\d?>>?", token) is not None and not redirect
                continue
            if token not in (";", "&&", "||", "|", "&"):
                current.append(token)
                continue
            if current[:1] == ["for"] and len(current) >= 4 and current[2] == "in":
                variables[current[1]] = current[3]  # the loop's first value stands for all
            elif current and all(re.fullmatch(r"[A-Za-z_]\w*=.*", t) for t in current):
                variables.update(t.split("=", 1) for t in current)  # VAR=value on its own
            elif current:
                commands.append((number, _expand(current, variables)))
            current = []
    return commands


def _expand(tokens: list[str], variables: dict[str, str]) -> list[str]:
    out: list[str] = []
    for token in tokens:
        whole = re.fullmatch(r"\$\{?([A-Za-z_]\w*)\}?", token)
        if whole and whole.group(1) in variables:
            out += shlex.split(variables[whole.group(1)])  # unquoted: split into words
            continue
        out.append(re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: variables.get(m.group(1), m.group(0)), token))
    return out


def _classify(tokens: list[str]) -> Optional[tuple[str, str, list[str]]]:
    """A simple command -> ("mmssl", "", argv) / ("tool", script, argv), or None if neither."""
    env: dict[str, str] = {}
    while tokens and (
        re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[0]) or tokens[0] in ("do", "nice", "env", "time", "srun")
    ):
        if "=" in tokens[0]:
            env.update([tokens[0].split("=", 1)])
        tokens = tokens[1:]
        if tokens[:1] == ["-n"]:  # nice -n N
            tokens = tokens[2:]
    if not tokens:
        return None
    if tokens[0] == "mmssl":
        return "mmssl", "", tokens[1:]
    if "-m" in tokens and tokens[0] in ("python", "python3", "torchrun"):
        at = tokens.index("-m")
        return ("mmssl", "", tokens[at + 2:]) if tokens[at + 1:at + 2] == ["mmssl"] else None
    if (
        tokens[0] in ("python", "python3")
        and len(tokens) > 1
        and re.fullmatch(r"(tools|benchmarks)/\w+\.py", tokens[1])
    ):
        return "tool", tokens[1], tokens[2:]
    if tokens[:2] == ["sbatch", "tools/slurm/train.sbatch"]:  # srun mmssl fit --config $CONFIG + ddp.yaml
        config = env.get("CONFIG", "configs/clip/vit_b32.yaml")
        return "mmssl", "", ["fit", "--config", config, "--config", "configs/trainer/ddp.yaml", *tokens[2:]]
    return None


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def extract(path: Path) -> tuple[list[Command], list[tuple[str, str, str]]]:
    """The commands and the mmssl YAML configs (where, base, text) of one markdown file."""
    text = path.read_text()
    name = path.relative_to(REPO).as_posix()
    found: list[Command] = []
    configs: list[tuple[str, str, str]] = []
    shell_parts: list[tuple[int, str]] = []
    for match in FENCE.finditer(text):
        info, body = match.group(2).split(), textwrap.dedent(match.group(3))
        lang = info[0] if info else ""
        where = f"{name}:{_line(text, match.start())}"
        if lang in ("yaml", "yml"):
            try:
                loaded = yaml.safe_load(body)
            except yaml.YAMLError:  # kept, so that its test fails with the parser's message
                loaded = {"data": None}
            if isinstance(loaded, dict) and loaded and set(loaded) <= CONFIG_KEYS:
                base = dict(i.split("=", 1) for i in info[1:] if "=" in i).get("base", BASE_CONFIG)
                configs.append((where, base, body))
        elif lang in SHELL_BLOCKS:
            shell_parts.append((match.start(3), body))
    prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets, no blocks
    shell_parts += [(m.start(1), m.group(1)) for m in INLINE.finditer(prose)]
    for offset, body in shell_parts:
        for number, tokens in _simple_commands(body):
            classified = _classify(tokens)
            if classified:
                kind, script, argv = classified
                found.append(Command(kind, tuple(argv), script, f"{name}:{_line(text, offset) + number}"))
    return found, configs


def _collect() -> tuple[list[Command], list[tuple[str, str, str]]]:
    commands: dict[tuple, Command] = {}
    configs: list[tuple[str, str, str]] = []
    for path in DOC_FILES:
        found, blocks = extract(path)
        for command in found:
            commands.setdefault(command.key, command)  # one parse per distinct command
        configs += blocks
    return list(commands.values()), configs


COMMANDS, CONFIGS = _collect()
MMSSL = [c for c in COMMANDS if c.kind == "mmssl"]
TOOLS = [c for c in COMMANDS if c.kind == "tool"]


def resolve(argv: list[str]) -> str:
    """``mmssl ARGV --print_config`` in-process; the printed config, or AssertionError with the CLI's words."""
    from mmssl.cli import cli_main

    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_main([*argv, "--print_config"])
        except SystemExit as exit_:
            code = exit_.code
    assert code in (0, None) and out.getvalue(), f"mmssl {shlex.join(argv)}\n{err.getvalue()[-3000:]}"
    return out.getvalue()


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


def parse_tool(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The tool's own argparse result for ARGV: its ``main`` runs up to its first parse, then stops."""
    assert (REPO / script).is_file(), f"{script} does not exist"
    spec = importlib.util.spec_from_file_location(f"_docs_{Path(script).stem}", REPO / script)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    depth = [0]

    def stopping(original):
        def parse(self, *args, **kwargs):
            if depth[0]:  # a sub-parser of the outermost parse
                return original(self, *args, **kwargs)
            depth[0] += 1
            try:
                namespace = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            raise _Parsed(namespace[0] if isinstance(namespace, tuple) else namespace)
        return parse

    monkeypatch.setattr("sys.argv", [script])  # argparse names the program after it
    for name in ("parse_args", "parse_known_args"):
        monkeypatch.setattr(argparse.ArgumentParser, name, stopping(getattr(argparse.ArgumentParser, name)))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            module.main(list(argv))
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as exit_:
        raise AssertionError(f"{script} {shlex.join(argv)}: exit {exit_.code}\n{err.getvalue()[-2000:]}") from None
    raise AssertionError(f"{script}: main() returned without parsing its arguments")


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the docs' paths are relative to the repository root
    monkeypatch.setattr("sys.argv", ["mmssl"])  # pytest's own arguments are not the CLI's


@pytest.mark.parametrize("command", MMSSL, ids=[c.where for c in MMSSL])
def test_mmssl_command_resolves(command: Command, in_repo) -> None:
    assert command.argv and command.argv[0] in SUBCOMMANDS, f"{command.where}: mmssl {shlex.join(command.argv)}"
    resolve(list(command.argv))


@pytest.mark.parametrize("command", TOOLS, ids=[c.where for c in TOOLS])
def test_tool_command_parses(command: Command, in_repo, monkeypatch: pytest.MonkeyPatch) -> None:
    namespace = parse_tool(command.script, list(command.argv), monkeypatch)
    overrides = getattr(namespace, "overrides", None)
    if command.script == "tools/benchmark.py" and overrides:  # what it hands on to `mmssl fit`
        resolve(["fit", "--config", namespace.config, *overrides])


@pytest.mark.parametrize("block", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_yaml_config_resolves(block: tuple[str, str, str], in_repo, tmp_path: Path) -> None:
    where, base, body = block
    path = tmp_path / "block.yaml"
    path.write_text(body)
    printed = yaml.safe_load(resolve(["fit", "--config", base, "--config", str(path)]))
    for key, value in yaml.safe_load(body).items():  # the block's values made it into the config
        if isinstance(value, dict) and "init_args" in value:
            assert printed[key]["class_path"].split(".")[-1] == value["class_path"].split(".")[-1], where


def test_docs_hold_the_workflows() -> None:
    """The extraction sees the README's commands (a parser that finds nothing would pass vacuously)."""
    readme = {c.argv for c in MMSSL if c.where.startswith("README.md")}
    assert ("fit", "--config", "configs/demo/clip.yaml") in readme
    assert len(MMSSL) >= 20 and len(TOOLS) >= 10 and CONFIGS, (len(MMSSL), len(TOOLS), len(CONFIGS))
    assert "pip install -e \".[test]\" && pytest" in (REPO / "README.md").read_text()  # CI's command


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move reference text to docs/"


def test_relative_links_exist() -> None:
    broken = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", path.read_text()):
            if not re.match(r"[a-z]+:", target) and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_extraction_reads_shell_as_a_reader_types_it() -> None:
    text = "\n".join([
        "CKPT=runs/x/last.ckpt   # a comment",
        'LIGHT="--a 1 --b 2"',
        "mmssl fit --config c.yaml $LIGHT \\",
        "  --trainer.default_root_dir=runs/w$w && python tools/zero_shot.py --ckpt $CKPT",
        "for w in 16 32; do nice -n 15 mmssl fit --config d.yaml --x=$w; done",
        "CONFIG=e.yaml sbatch tools/slurm/train.sbatch --data.train_data 'a b'",
        "torchrun --nnodes 2 -m mmssl fit --config f.yaml",
        "$ python tools/plan_stream.py --data 'x/{0..9}.tar'",
        "pip install -e . && tensorboard --logdir runs",
    ])
    got = [_classify(tokens) for _, tokens in _simple_commands(text)]
    assert [g for g in got if g] == [
        ("mmssl", "", ["fit", "--config", "c.yaml", "--a", "1", "--b", "2", "--trainer.default_root_dir=runs/w$w"]),
        ("tool", "tools/zero_shot.py", ["--ckpt", "runs/x/last.ckpt"]),
        ("mmssl", "", ["fit", "--config", "d.yaml", "--x=16"]),
        (
            "mmssl",
            "",
            ["fit", "--config", "e.yaml", "--config", "configs/trainer/ddp.yaml", "--data.train_data", "a b"],
        ),
        ("mmssl", "", ["fit", "--config", "f.yaml"]),
        ("tool", "tools/plan_stream.py", ["--data", "x/{0..9}.tar"]),
    ]
