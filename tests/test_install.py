"""mmssl as a package: a plain ``pip install`` gives every recipe, model config and tool, from any folder.

``.ci/clean_install`` builds the wheel, installs it into a fresh venv that cannot see the clone and,
from an empty folder, trains the demo recipe by name, exports and probes through the subcommands.
The rest runs in-process: recipe names, ``mmssl configs``, the tool subcommands and their errors.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmssl.cli import main
from mmssl.commands import recipe_names, resolve_config, resolve_run_arguments, tools

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.relative_to(REPO / "configs").with_suffix("").as_posix() for p in (REPO / "configs").rglob("*.yaml"))


def _exit(args: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(args)
    return info.value.code


def test_a_clean_wheel_install_trains_exports_and_probes_from_an_empty_folder(tmp_path):
    # The interpreter running the tests (a user's venv, or CI's) is the one whose packages the new venv takes.
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run([str(REPO / ".ci" / "clean_install"), str(tmp_path)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for check in ("every recipe, model JSON, tool and module", f"mmssl from {tmp_path}/venv/",
                  "mmssl fit --config demo/clip", "mmssl export --format open_clip", "mmssl probe -> probe.json",
                  "python -m mmssl.tools.zero_shot --help", "all checks passed"):
        assert check in run.stdout, run.stdout


def test_every_recipe_resolves_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert recipe_names() == RECIPES and "demo/clip" in RECIPES
    for name in RECIPES:
        shipped = (REPO / "configs" / f"{name}.yaml").resolve()
        for spelling in (name, f"{name}.yaml", f"configs/{name}.yaml"):
            path, note = resolve_config(spelling)
            assert Path(path) == shipped and note == f"--config {spelling}: the shipped recipe {shipped}"


def test_a_local_file_of_a_recipes_name_wins_and_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "clip.yaml").write_text("seed_everything: 1\n")
    path, note = resolve_config("demo/clip.yaml")
    assert path == "demo/clip.yaml"
    assert note == (f"--config demo/clip.yaml: your file {tmp_path / 'demo' / 'clip.yaml'}, "
                    f"not the shipped recipe {(REPO / 'configs' / 'demo' / 'clip.yaml').resolve()}")
    # The extension-less name is no file here: the shipped recipe, said on stderr.
    assert resolve_run_arguments(["fit", "--config", "demo/clip", "--config=demo/clip.yaml", "--x", "1"]) == [
        "fit", "--config", str((REPO / "configs" / "demo" / "clip.yaml").resolve()), "--config=demo/clip.yaml",
        "--x", "1"]
    err = capsys.readouterr().err
    assert "--config demo/clip: the shipped recipe" in err and "--config demo/clip.yaml: your file" in err
    # In the clone a recipe's path is the shipped file itself: nothing to say.
    monkeypatch.chdir(REPO)
    assert resolve_config("configs/demo/clip.yaml") == ("configs/demo/clip.yaml", None)


def test_a_recipe_name_matching_nothing_fails_naming_the_closest(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _exit(["fit", "--config", "demo/clp", "--trainer.max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--config demo/clp: no such file here, nor a shipped recipe of that name; the closest: demo/clip" in err
    assert _exit(["fit", "--config", "vit_b32"]) == 2
    assert "the closest: clip/vit_b32, coca/vit_b32" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_mmssl_configs_lists_every_recipe_and_copies_one_out(tmp_path, capsys):
    assert _exit(["configs"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == RECIPES
    assert _exit(["configs", "--copy", "demo/clip", str(tmp_path)]) == 0
    assert filecmp.cmp(tmp_path / "clip.yaml", REPO / "configs" / "demo" / "clip.yaml", shallow=False)
    assert _exit(["configs", "--copy", "models/clip_tiny.json", str(tmp_path / "mine.json")]) == 0
    assert filecmp.cmp(tmp_path / "mine.json", REPO / "configs" / "models" / "clip_tiny.json", shallow=False)
    capsys.readouterr()
    assert _exit(["configs", "--copy", "demo/clip", str(tmp_path)]) == 1  # never overwrites an edited copy
    assert f"{tmp_path / 'clip.yaml'} exists" in capsys.readouterr().err
    assert _exit(["configs", "--copy", "demo/clp", str(tmp_path)]) == 1
    assert "the closest: demo/clip" in capsys.readouterr().err


def test_help_lists_every_tool_as_a_subcommand_with_one_line(capsys):
    assert _exit(["--help"]) == 0
    out = capsys.readouterr().out
    modules = sorted(p.stem for p in (REPO / "tools").glob("*.py") if not p.stem.startswith("_"))
    table = tools()
    assert sorted(table.values()) == modules
    assert table["probe"] == "linear_probe" and table["zero-shot"] == "zero_shot" and table["export"] == "export"
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for name in ("fit", "validate", "test", "predict", "configs", *table):
        assert name in lines and len(lines[name].split()) > 2, name  # a name and its line
    assert "Export an mmssl checkpoint for another library." in lines["export"]


def test_a_tool_runs_as_a_subcommand_with_its_own_arguments_and_exit_status(tmp_path, capsys):
    assert _exit(["export", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: mmssl export [-h] --ckpt CKPT --format")
    missing = tmp_path / "missing.ckpt"
    assert _exit(["export", "--ckpt", str(missing), "--format", "timm", "--output", str(tmp_path / "x.pth")]) == 1
    assert f"export: --ckpt: no checkpoint file at '{missing}'" in capsys.readouterr().err
    assert _exit(["linear-probe", "--help"]) == 0  # the file's own name works too
    assert capsys.readouterr().out.startswith("usage: mmssl probe")


def test_an_unknown_subcommand_fails_with_the_valid_ones(capsys):
    assert _exit(["expor", "--ckpt", "x"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'expor' (did you mean export?); valid: fit, validate, test, predict, configs, " in err
    assert all(name in err for name in tools())


def test_a_tool_runs_by_path_in_a_clone_and_as_a_module_from_any_folder(tmp_path):
    for command in ([sys.executable, str(REPO / "tools" / "inspect_shards.py"), "--help"],
                    [sys.executable, "-m", "mmssl.tools.inspect_shards", "--help"]):
        run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]
