"""The package's shape: imports run only downward (model, analysis <- data, training <- experiments <- pretrained /
bench <- doctor, report <- cli) and no module imports itself back through a cycle. Read from the source, every import
counted (also those inside functions), so a lazy import cannot hide an upward dependency."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "tapelm"

# What each part may import besides itself. "model" is tapelm's own top-level modules, positional/ and kernels/.
ALLOWED = {
    "model": {"model"},
    "analysis": {"analysis"},
    "data": {"model", "data"},
    "training": {"model", "training"},
    "experiments": {"model", "analysis", "data", "training", "experiments"},
    "pretrained": {"model", "analysis", "data", "training", "experiments", "pretrained"},
    "bench": {"model", "analysis", "data", "training", "experiments", "bench"},
    "doctor": {"model", "analysis", "data", "training", "experiments", "bench", "doctor"},
    "scrolls": {"model", "analysis", "data", "training", "experiments", "pretrained", "scrolls"},
    "report": {"model", "analysis", "data", "training", "experiments", "pretrained", "scrolls", "report"},
    "cli": {
        "model",
        "analysis",
        "data",
        "training",
        "experiments",
        "pretrained",
        "bench",
        "doctor",
        "scrolls",
        "report",
        "cli",
    },
}
# The parts above experiments/ and how many names they may take from it (issue 64: at most 15). What is not about
# experiments lives below them: the run machinery in training/, intervals, markdown and figures in analysis/, corpora,
# tokenizers, batches and the passkey text in data/, TAPE's named variants beside the config; the report reads the
# comparisons, claims and plan through those modules (`compare.aggregate`, `plan.GPU`).
UPPER_PARTS = ("pretrained", "scrolls", "bench", "doctor", "report")
MOST_NAMES_FROM_EXPERIMENTS = 15
FACADE = PACKAGE  # tapelm/__init__.py: the public API, which nothing inside the package imports


def module_files(src: Path) -> dict[str, Path]:
    files = {}
    for path in (src / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def part_of(module: str) -> str:
    parts = module.split(".")
    if module == FACADE:
        return "facade"
    return parts[1] if parts[1] in ALLOWED else "model"


def package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def source_of(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from ... import` reads from, relative forms resolved against `package`."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The tapelm modules `module` imports; `from pkg import name` counts as pkg.name when that is a module."""
    package = package_of(module, path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            target = source_of(node, package)
            if target.split(".")[0] != PACKAGE:
                continue
            submodules = {f"{target}.{alias.name}" for alias in node.names} & modules
            found.update(submodules or {target})
    return {name for name in found if name in modules and name != module}


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    files = module_files(src)
    return {module: imports_of(module, path, set(files)) for module, path in files.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [
        (module, target)
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if part_of(module) != "facade"
        and (part_of(target) == "facade" or part_of(target) not in ALLOWED[part_of(module)])
    ]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path + [module, target]
                return cycle[cycle.index(target) :]
            if target not in state and (cycle := visit(target, path + [module])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [])):
            return cycle
    return None


def names_from_experiments(src: Path = SRC) -> set[str]:
    """The distinct names the parts above experiments/ (but the command) import from it: every X of `from
    tapelm.experiments[.module] import X` and its relative spellings, also inside functions."""
    experiments = f"{PACKAGE}.experiments"
    names = set()
    for module, path in module_files(src).items():
        if part_of(module) not in UPPER_PARTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                source = source_of(node, package_of(module, path))
                if source == experiments or source.startswith(experiments + "."):
                    names.update(alias.name for alias in node.names)
    return names


def test_the_three_parts_exist():
    parts = {part_of(module) for module in module_files(SRC)}
    assert {"model", "training", "experiments", "pretrained", "bench", "doctor", "report", "cli"} <= parts


def test_imports_only_run_downward_and_nothing_imports_the_facade():
    assert upward_imports(import_graph()) == []


def test_there_is_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    """Both rules fail when broken: a copy of the package whose attention module imports the experiments' runs
    (which import the model, hence attention again)."""
    import shutil

    shutil.copytree(SRC / PACKAGE, tmp_path / PACKAGE)
    attention = tmp_path / PACKAGE / "kernels" / "attention" / "__init__.py"
    attention.write_text(attention.read_text() + "\n\ndef _late():\n    from ...experiments import runs\n")
    graph = import_graph(tmp_path)
    assert ("tapelm.kernels.attention", "tapelm.experiments.runs") in upward_imports(graph)
    assert "tapelm.kernels.attention" in find_cycle(graph)


def test_the_parts_above_take_few_names_from_experiments_and_the_run_machinery_from_training():
    names = names_from_experiments()
    assert len(names) <= MOST_NAMES_FROM_EXPERIMENTS, sorted(names)
    training = set()
    for path in (SRC / PACKAGE / "training").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                training.add(node.name)
            elif isinstance(node, ast.Assign):
                training.update(target.id for target in node.targets if isinstance(target, ast.Name))
    assert names & training == set()  # e.g. TrainSettings, write_json_atomically: from training/, not re-exported


def test_the_name_count_sees_relative_absolute_and_nested_imports(tmp_path):
    report = tmp_path / PACKAGE / "report"
    report.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (report / "__init__.py").write_text("from ..experiments.compare import aggregate as summed\n")
    (report / "section.py").write_text(
        "from tapelm.experiments import plan\n"
        "from ..experiments.tasks.passkey import KEY_LOW, question\n"
        "from ..training.atomic import write_json_atomically\n"
        "def late():\n    from .. import experiments\n    from ..experiments.runs import RunSpec\n"
    )
    assert names_from_experiments(tmp_path) == {"aggregate", "plan", "KEY_LOW", "question", "RunSpec"}


# What `pip install tapelm` installs (pyproject.toml's dependencies, and what transformers needs: numpy, packaging),
# and the kernels' libraries, imported only when their kernels run on a device that has them.
MODEL_PACKAGES = {"torch", "transformers", "safetensors", "numpy", "packaging", "triton", "fla"}


def third_party_imports(path: Path) -> set[str]:
    """The top-level packages a file imports that are neither tapelm nor the standard library."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {PACKAGE, "__future__"} - set(sys.stdlib_module_names)


def test_the_model_library_imports_only_what_pip_install_tapelm_installs():
    """The model (and the public API) runs without the lab's extra: CI's bare stage installs `tapelm` alone and
    builds, trains, generates, saves and loads every encoding there (.ci/bare.py)."""
    outside = {
        module: sorted(third_party_imports(path) - MODEL_PACKAGES)
        for module, path in module_files(SRC).items()
        if part_of(module) in ("model", "facade")
    }
    assert {module: found for module, found in outside.items() if found} == {}
    assert third_party_imports(SRC / PACKAGE / "training" / "accelerator.py") - MODEL_PACKAGES  # the check sees one


def test_a_lab_command_without_the_lab_names_the_extra_in_one_line(monkeypatch, capsys):
    import tapelm.cli as cli

    monkeypatch.setattr(cli, "missing", lambda extra: ["accelerate", "peft"] if extra == "lab" else [])
    assert cli.main(["compare", "mqar", "--pe", "rope"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        "tapelm: error: `tapelm compare` is a lab command and needs tapelm's lab extra, which is not installed "
        "(missing: accelerate, peft): pip install 'tapelm[lab]'"
    ]
    assert "check-encoding" in cli.build_parser(lab=False).format_help()
