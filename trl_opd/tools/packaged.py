"""The recipes and accelerate configs shipped inside the package (`trl_opd/recipes/`), found by name.

    trl-opd recipes                      # each recipe with the first sentence of its header
    trl-opd --config smoke_cpu           # a shipped recipe by name; a path to a YAML file works as always
    accelerate launch --config_file $(trl-opd config-path cpu) -m trl_opd --config smoke_cpu

A recipe's paths (models, datasets, output_dir) are relative to the folder it runs from, as for a recipe of your own:
the CPU recipes' headers say which `trl-opd make-...` command builds what they read there.
"""

from __future__ import annotations

import argparse
import difflib
import re
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
ACCELERATE = RECIPES / "accelerate"


def recipe_path(name_or_path: str) -> Path:
    """A recipe given as a path (used as it is) or as the name of a shipped one (`smoke_cpu`, `smoke_cpu.yaml`)."""
    path = Path(name_or_path)
    if path.exists() or len(path.parts) > 1:
        return path  # a path: a missing file is the parser's to report, with its own name
    shipped = RECIPES / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if shipped.exists():
        return shipped
    raise SystemExit(_not_found(f"--config {name_or_path!r} is neither a file nor a recipe shipped with trl_opd",
                                name_or_path, _names(RECIPES), "trl-opd recipes"))


def accelerate_config_path(name_or_path: str) -> Path:
    """A shipped accelerate config by name (`cpu`, `zero3`, ...), or a path as given."""
    path = Path(name_or_path)
    if path.exists() or len(path.parts) > 1:
        return path
    shipped = ACCELERATE / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if shipped.exists():
        return shipped
    raise SystemExit(_not_found(f"no accelerate config {name_or_path!r} is shipped with trl_opd", name_or_path,
                                _names(ACCELERATE), "trl-opd config-path --list"))


def purpose(path: Path) -> str:
    """The first sentence of a YAML file's header comment."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    return re.split(r"(?<=\.)\s", " ".join(header), maxsplit=1)[0]


def recipes_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="trl-opd recipes", description="List the recipes shipped with trl_opd.")
    parser.parse_args(argv)
    names = _names(RECIPES)
    width = max(map(len, names))
    print(f"Recipes shipped with trl_opd (in {RECIPES}); run one with `trl-opd --config NAME`:")
    for name in names:
        print(f"  {name:<{width}}  {_shortened(purpose(RECIPES / f'{name}.yaml'), 116 - width)}")
    print("Accelerate configs (`trl-opd config-path NAME`): " + ", ".join(_names(ACCELERATE)))


def config_path_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="trl-opd config-path", description="Print the path of an accelerate config shipped with trl_opd, for "
        "`accelerate launch --config_file $(trl-opd config-path NAME) -m trl_opd --config RECIPE`.")
    parser.add_argument("name", nargs="?", help="a shipped config, e.g. cpu, single_gpu, zero3 or fsdp2 (--list: all)")
    parser.add_argument("--list", action="store_true", help="list the shipped configs, each with its purpose")
    args = parser.parse_args(argv)
    if args.list or args.name is None:
        for name in _names(ACCELERATE):
            print(f"  {name:<14}  {purpose(ACCELERATE / f'{name}.yaml')}")
        if args.name is None and not args.list:
            parser.exit(2, "trl-opd config-path: name a config, e.g. `trl-opd config-path cpu`\n")
        return
    print(accelerate_config_path(args.name))


def _shortened(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 4].rsplit(" ", 1)[0] + " ..."


def _names(folder: Path) -> list[str]:
    return sorted(path.stem for path in folder.glob("*.yaml"))


def _not_found(what: str, name: str, names: list[str], listing: str) -> str:
    close = difflib.get_close_matches(name.removesuffix(".yaml"), names, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{what}.{hint} `{listing}` lists them."
