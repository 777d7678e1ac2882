"""The `flux-grpo` dispatcher (tools/cli.py) in-process: the table holds every tool in its group and no maintainer tool,
the listing imports nothing heavy, a command gets its argv and its exit code comes back unchanged (2 for bad input),
`python -m tools` is the same table. The installed command, from another folder: tests/recipe/test_packaging.py."""

from __future__ import annotations

import ast
import importlib
import sys
import types

import pytest

from tests import ROOT
from tools import cli


def _tools_with_main() -> set[str]:
    found = set()
    for path in (ROOT / "tools").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if not path.stem.startswith("_") and path.stem != "cli" and any(
                isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            found.add(f"tools.{path.stem}")
    return found


def test_every_tool_with_a_main_is_a_command_and_every_target_exists():
    targets = {cmd.target.partition(":")[0] for cmd in cli.COMMANDS.values()}
    assert _tools_with_main() <= targets, "add the new tool to tools/cli.py COMMANDS"
    assert all(name == name.lower() and "_" not in name for name in cli.COMMANDS)
    for name, cmd in cli.COMMANDS.items():
        module, _, func = cmd.target.partition(":")
        tree = ast.parse((ROOT / f"{module.replace('.', '/')}.py").read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name == func for n in tree.body), name
        assert cmd.summary and len(cmd.summary) < 100


def test_the_commands_are_listed_in_their_groups():
    assert {group: list(commands) for group, commands in cli.GROUPS.items()} == {
        "train and inspect": ["train", "check", "plan", "prompts"],
        "evaluate and ship": ["eval", "bench", "compare", "export", "report", "rewards"],
        "porting to NPU": ["align", "npu-audit", "device-check"],
        "launcher plumbing": ["torchrun", "deepspeed-run"],
    }
    assert list(cli.COMMANDS) == [name for commands in cli.GROUPS.values() for name in commands]
    listed = cli.listing()
    for group, commands in cli.GROUPS.items():  # each group's header, then its commands, in order
        block = listed.split(f"\n{group}:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert [line.split()[0] for line in block] == list(commands)


def test_no_maintainer_tool_is_a_command():
    """The tiny worlds' builders live in maintainer/ (unpackaged); the product's table never reaches them."""
    assert not [cmd.target for cmd in cli.COMMANDS.values() if not cmd.target.startswith("tools.")]
    assert not {"build-tiny", "tiny-prompts"} & set(cli.COMMANDS)
    assert not list((ROOT / "tools").glob("*tiny*"))


@pytest.mark.parametrize("argv", [[], ["--help"]])
def test_no_command_lists_them_without_importing_the_tools(argv, capsys, monkeypatch):
    for name in [m for m in sys.modules if m.startswith("tools.") and m != "tools.cli"]:
        monkeypatch.delitem(sys.modules, name)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flux-grpo COMMAND") and all(f"\n  {name} " in out for name in cli.COMMANDS)
    assert not [m for m in sys.modules if m.startswith("tools.") and m != "tools.cli"]


def _fake(monkeypatch, result):
    seen = []

    def main(argv):
        seen.append((list(argv), sys.argv[0]))
        if isinstance(result, BaseException):
            raise result
        return result

    module = types.ModuleType("tools._fake_tool")
    module.main = main
    monkeypatch.setitem(sys.modules, "tools._fake_tool", module)
    monkeypatch.setitem(cli.COMMANDS, "fake", cli.Command("tools._fake_tool:main", "a stand-in"))
    monkeypatch.setattr(sys, "argv", ["flux-grpo"])
    return seen


@pytest.mark.parametrize("result, code", [(0, 0), (None, 0), (2, 2), (3, 3), (SystemExit(2), 2), (SystemExit(None), 0),
                                          (SystemExit(5), 5)])
def test_a_command_gets_its_argv_and_its_exit_code_passes_through(monkeypatch, result, code):
    seen = _fake(monkeypatch, result)
    assert cli.main(["fake", "a.yaml", "max_steps=1"]) == code
    assert seen == [(["a.yaml", "max_steps=1"], "flux-grpo fake")]


def test_an_unknown_command_is_bad_input_in_one_line(capsys):
    assert cli.main(["trian", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: flux-grpo: unknown command 'trian'; one of: train, check") and err.count("\n") == 1


def test_check_with_a_bad_key_exits_2_with_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["flux-grpo"])
    preset = ROOT / "recipes" / "configs" / "tiny" / "nft_lora.yaml"
    assert cli.main(["check", "--resolved", str(preset), "no_such_key=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no_such_key" in err and err.count("\n") == 1


def test_bad_usage_of_a_tool_is_argparse_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["flux-grpo"])
    assert cli.main(["check"]) == 2  # no CONFIG
    assert "usage:" in capsys.readouterr().err


def test_train_runs_the_recipe_main_loaded_by_path(monkeypatch):
    import tools._recipe

    got = []
    monkeypatch.setattr(tools._recipe, "load_recipe", lambda: types.SimpleNamespace(main=lambda a: got.append(a) or 2))
    monkeypatch.setattr(sys, "argv", ["flux-grpo"])
    assert cli.main(["train", "--config", "c.yaml", "max_steps=1"]) == 2
    assert got == [["--config", "c.yaml", "max_steps=1"]]


def test_python_m_tools_is_the_same_table(capsys):
    source = (ROOT / "tools" / "__main__.py").read_text()
    assert "from tools.cli import main" in source and "ast" not in source.split('"""', 2)[2]
    assert cli.main([], prog="python -m tools") == 0
    assert capsys.readouterr().out.startswith("usage: python -m tools COMMAND")


def test_the_recipe_is_part_of_a_package():
    assert (ROOT / "recipes" / "__init__.py").is_file()
    assert importlib.util.find_spec("recipes") is not None
