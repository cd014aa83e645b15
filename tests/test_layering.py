"""The package's imports follow the layer map (README, "Layers"): a module imports only from
its own layer or the layers below, visual generation sits on layers 0-3 only, and no import
cycle exists. Imports inside functions count; imports under `if TYPE_CHECKING:` do not (they
never run)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tllm"

# module prefix -> layer, lowest first; the longest matching prefix wins.
LAYERS = {
    "tllm": 0, "tllm.request": 0, "tllm.sampling_params": 0, "tllm.outputs": 0,
    "tllm.tokenizer": 0, "tllm.config": 0, "tllm.cli_types": 0,
    "tllm.cli_parser": 0, "tllm.device": 0,
    "tllm.cpu_threads": 0,
    "tllm.kernels": 1,
    "tllm.layers": 2, "tllm.attention": 2, "tllm.distributed.mapping": 2,
    "tllm.distributed.comm": 2, "tllm.distributed.rendezvous": 2,
    "tllm.models": 3, "tllm.loader": 3,
    "tllm.multimodal": 3, "tllm.multimodal.inputs": 0, "tllm.multimodal.media": 0,
    "tllm.multimodal.chat": 0, "tllm.multimodal.fetch": 0,
    "tllm.kv_cache": 4, "tllm.scheduler": 4, "tllm.sampling": 4, "tllm.speculative": 4,
    "tllm.lora": 4, "tllm.lora.request": 0, "tllm.guided": 4,
    "tllm.runner": 5,
    "tllm.executor": 6, "tllm.disagg": 6, "tllm.distributed.launch": 6, "tllm.distributed.ray_launcher": 6,
    "tllm.llmapi": 7,
    "tllm.serve": 8, "tllm.bench": 8, "tllm.visual_gen": 8,
    "tllm.cli": 9,
}
VISUAL_GEN_MAX_LAYER = 3  # besides itself


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Import statements that run: everything but the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = node.orelse
        stack.extend(children)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The tllm modules a file imports (`from pkg import mod` names mod itself)."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        found.update(n for n in names if n == "tllm" or n.startswith("tllm."))
    found.discard(this)
    return found


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imported_modules(f, modules) for f in files}


GRAPH = import_graph()


def test_the_map_names_every_module():
    assert all(layer_of(m) is not None for m in GRAPH)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_down_the_layers(module):
    layer = layer_of(module)
    bad = []
    for target in sorted(GRAPH[module]):
        target_layer = layer_of(target)
        if module.startswith("tllm.visual_gen"):
            ok = target.startswith("tllm.visual_gen") or target_layer <= VISUAL_GEN_MAX_LAYER
        else:
            ok = target_layer <= layer
        if not ok:
            bad.append(f"{target} (layer {target_layer})")
    assert not bad, f"{module} (layer {layer}) imports from above: {', '.join(bad)}"


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles():
    assert find_cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
