"""Private torch and Triton APIs only in ``sgl_piecewise/internals/``: every
other module of the package names only their documented surface, in code
(attribute chains, imports, ``getattr``) and in the module names it hands
to importlib."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "sgl_piecewise"
INTERNALS = PACKAGE / "internals"

# Underscored names that torch documents for use outside torch: a name here
# and everything under it may be used anywhere.
DOCUMENTED = (
    "torch._dynamo.config",  # torch.compiler's troubleshooting and config pages
    "torch._dynamo.mark_dynamic",  # the dynamic shapes guide
    "torch._dynamo.decorators.mark_unbacked",  # the dynamic shapes guide (no torch._dynamo.mark_unbacked in 2.13)
    "torch._dynamo.register_backend",  # the custom backends guide
    "torch._inductor.config",  # Inductor's config, the torch.compile tutorials
    "torch._check",  # the dynamic shapes guide's runtime asserts
)
# Triton modules with no documented API; ``triton._*`` is private too.
PRIVATE_TRITON = ("triton.runtime", "triton.compiler", "triton.backends")
# Undocumented names used outside internals/ and still to move there (none
# now). Each entry is checked to be still in use, so a move must delete it here.
NOT_YET_MOVED: set = set()

IMPORTLIB_CALLS = ("import_module", "find_spec", "__import__")
ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def _underscored(part: str) -> bool:
    return part.startswith("_") and not part.endswith("__")  # dunders are public


def is_private(name: str) -> bool:
    """Whether a dotted name reaches a private torch or Triton API."""
    parts = name.split(".")
    if parts[0] not in ("torch", "triton") or not any(_underscored(p) for p in parts[1:]):
        return parts[0] == "triton" and any(name == m or name.startswith(m + ".") for m in PRIVATE_TRITON)
    return not any(name == d or name.startswith(d + ".") for d in DOCUMENTED)


def _dotted(node: ast.AST, aliases: dict) -> str | None:
    """``torch._dynamo.config`` for ``torch._dynamo.config`` (or ``dynamo.config``
    after ``import torch._dynamo as dynamo``); None if it does not start at a
    module name bound by an import."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _call_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def names_used(source: str):
    """(line, dotted name) of every torch or Triton name a module's code uses."""
    tree = ast.parse(source)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                aliases[alias.asname or top] = alias.name if alias.asname else top
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                yield node.lineno, f"{node.module}.{alias.name}"
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            name = _dotted(node, aliases)
            if name is not None:
                yield node.lineno, name
        elif isinstance(node, ast.Call) and node.args:
            first, call = node.args[0], _call_name(node.func)
            if call in IMPORTLIB_CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value
            elif call in ATTRIBUTE_CALLS and len(node.args) > 1:
                owner, attr = _dotted(first, aliases), node.args[1]
                if owner is not None and isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                    yield node.lineno, f"{owner}.{attr.value}"


def private_uses(root: pathlib.Path = PACKAGE):
    """(path relative to the package, line, name) of every private name used outside internals/."""
    for path in sorted(root.rglob("*.py")):
        if INTERNALS in path.parents:
            continue
        for line, name in names_used(path.read_text(encoding="utf-8")):
            if is_private(name):
                yield path.relative_to(root).as_posix(), line, name


def test_no_private_torch_or_triton_name_is_used_outside_internals():
    found = [f"{path}:{line}: {name}" for path, line, name in private_uses() if (path, name) not in NOT_YET_MOVED]
    assert not found, "private names outside sgl_piecewise/internals/, to move there:\n" + "\n".join(found)


def test_every_entry_not_yet_moved_is_still_used():
    used = {(path, name) for path, _, name in private_uses()}
    assert NOT_YET_MOVED <= used


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nimportlib.util.find_spec('torch._dynamo.variables.invoke_subgraph')",
        "import importlib\nimportlib.import_module('triton.runtime.jit')",
        "import torch\ntorch._C._cuda_clearCublasWorkspaces()",
        "import torch._dynamo as dynamo\ndynamo.utils.counters",
        "from torch._subclasses.fake_tensor import FakeTensor",
        "from torch import _higher_order_ops",
        "import torch\nf = getattr(torch, '_foreach_copy_', None)",
        "from triton.compiler import CompiledKernel",
        "import triton\ntriton._C.libtriton",
        "import torch\ntorch._inductor.standalone_compile",
    ],
)
def test_the_rule_finds_each_kind_of_private_use(source):
    assert [name for _, name in names_used(source) if is_private(name)]


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch._dynamo.config.patch(x=1)",
        "import torch\ntorch._dynamo.decorators.mark_unbacked(t, 0)",
        "from torch._dynamo import register_backend",
        "import torch\ntorch._check(n > 0)",
        "import torch\ntorch.__version__",
        "import triton\nimport triton.language as tl\ntriton.cdiv(8, 2); tl.constexpr",
        "'torch._dynamo.utils.counters'  # a docstring names it, code does not use it",
    ],
)
def test_the_documented_surface_passes(source):
    assert [name for _, name in names_used(source) if is_private(name)] == []


def test_the_internals_module_for_regions_is_available_and_its_fallback_traces_every_call(monkeypatch):
    """``regions.py`` reaches Dynamo's subgraph reuse only through
    ``internals/region_reuse.py``; with it forced off, regions run as written."""
    from sgl_piecewise import regions
    from sgl_piecewise.internals import region_reuse

    assert region_reuse.AVAILABLE, region_reuse.UNAVAILABLE_REASON
    assert region_reuse.TORCH_VERSIONS == ("2.11", "2.13") and "2.11-2.13" in region_reuse.__doc__
    assert regions.regions_available()
    monkeypatch.setattr(region_reuse, "AVAILABLE", False)
    assert not regions.regions_available()
    with regions.tracing_regions() as on:
        assert on is False
