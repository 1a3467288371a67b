"""The package's structure: layers import only downward (import-linter, in
CI), and no module imports another module's private name."""

import ast
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "sgl_piecewise"


def _private_imports():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sgl_piecewise"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.endswith("__"):  # dunders are public
                        yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {node.module}.{alias.name}"


def test_no_module_imports_another_modules_private_name():
    assert list(_private_imports()) == []


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_the_layers_contract_holds():
    root = PACKAGE.parent
    done = subprocess.run(["lint-imports"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("grimp") is None, reason="grimp (import-linter's graph) is not installed")
def test_no_module_takes_part_in_an_import_cycle():
    import grimp

    graph = grimp.build_graph("sgl_piecewise")
    cycles = [
        (module, other)
        for module in sorted(graph.modules)
        for other in graph.find_modules_directly_imported_by(module)
        if graph.chain_exists(importer=other, imported=module)
    ]
    assert cycles == []
