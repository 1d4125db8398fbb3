"""The import layers of docs/architecture.md, checked on the source: a module imports only
modules of lower layers (and its own folder); testing/ may import anything."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "g2rpo_jax"

# docs/architecture.md, "What may import what".
LAYERS = {
    "core": 0, "parallel": 0,
    "models": 1, "sampling": 1,
    "rl": 2, "data": 2,
    "rewards": 3,
    "run": 4,
    "tasks": 5,
    "train": 6, "pretrain": 6, "evaluate": 6, "preprocess": 6, "convert": 6, "export": 6,
    "main": 7,
}


def _unit(relative: pathlib.Path) -> str:
    """The module or folder a file belongs to: "rl" for rl/loss.py, "train" for train.py."""
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imported_units(path: pathlib.Path) -> set[str]:
    units = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "g2rpo_jax":
                names = [alias.name for alias in node.names]
            elif node.module.startswith("g2rpo_jax."):
                names = [node.module.split(".")[1]]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names
                     if a.name.startswith("g2rpo_jax.")]
        units.update(names)
    return units


def _violations(package: pathlib.Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        unit = _unit(relative)
        if unit in ("testing", "__init__"):
            continue
        for imported in sorted(_imported_units(path) - {unit}):
            if imported not in LAYERS:
                found.append(f"{relative} imports {imported}, which has no layer")
            elif LAYERS[imported] >= LAYERS[unit]:
                found.append(f"{relative} (layer {LAYERS[unit]}) imports {imported} "
                             f"(layer {LAYERS[imported]})")
    return found


def test_every_module_has_a_layer():
    units = {_unit(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert units - set(LAYERS) - {"testing", "__init__"} == set()


def test_modules_import_only_lower_layers():
    assert _violations() == []


def test_the_check_sees_an_upward_import(tmp_path):
    """Positive control: a models/ file that imports the RL code is reported."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.py").write_text("from g2rpo_jax.rl import loss\n"
                                              "import g2rpo_jax.core.dtypes\n")
    assert _violations(tmp_path) == ["models/x.py (layer 1) imports rl (layer 2)"]


@pytest.mark.parametrize("folder", ["sampling", "rl"])
def test_math_folders_do_no_io_or_placement(folder):
    """sampling/ and rl/ are pure functions: no storage, no mesh building, no device_put."""
    for path in (PACKAGE / folder).glob("*.py"):
        text = path.read_text(encoding="utf-8")
        for forbidden in ("device_put", "make_mesh", "open(", "storage"):
            assert forbidden not in text, f"{path.name} uses {forbidden}"


# docs/architecture.md, "Folders and modules": the package's top level holds the programs (each
# runs as `python -m g2rpo_jax.<name>`); everything else lives in a folder named for its job.
PROGRAMS = {"main", "train", "pretrain", "evaluate", "preprocess", "convert", "export"}


def test_the_top_level_holds_only_programs():
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == PROGRAMS
    assert {unit for unit, layer in LAYERS.items() if layer >= 6} == PROGRAMS
