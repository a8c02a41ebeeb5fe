"""vLLM's Python sources read with ``ast``: which classes, methods, parameters and attributes a release has.

Nothing is imported, so the same reading works on the installed vLLM (at engine start, ``engine_api``) and on
the sources of a GPU wheel that cannot be imported on this machine (``scripts/vllm_matrix.py``). It knows
Python, not vLLM: a name is looked up where it is defined, following ``from X import name`` re-exports and base
classes inside the tree; what a class accepts or holds is read from its ``__init__`` (or, without one, its
annotated fields: dataclasses, msgspec structs, TypedDicts), its methods, properties, class attributes, enum
members and every ``self.x = ...`` in its methods.
"""

from __future__ import annotations

import ast
import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path

MAX_RE_EXPORTS = 8  # `from a import x` chains followed before giving up (vLLM's are one or two deep)


@dataclass
class ClassInfo:
    """What one class of the tree defines, its bases' members included (the class's own win)."""

    module: str
    name: str
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    method_modules: dict[str, str] = field(default_factory=dict)  # the module each method is defined in
    attributes: set[str] = field(default_factory=set)  # class attributes, enum members, self.x in methods
    fields: list[str] = field(default_factory=list)  # annotated class-level names, bases' first


@dataclass(frozen=True)
class Parameters:
    names: tuple[str, ...]
    any_keyword: bool  # **kwargs


class SourceTree:
    """The modules under ``root``, the directory that holds the top-level package (``root/vllm/...``)."""

    def __init__(self, root: str | Path, replaced: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        self.replaced = dict(replaced or {})  # module -> source read instead of the file (tests re-sign calls)
        self._modules: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._modules:
            if name in self.replaced:
                with _PARSE_LOCK:
                    self._modules[name] = ast.parse(self.replaced[name])
            else:
                path = self._path(name)
                self._modules[name] = _parsed(str(path), path.stat().st_mtime_ns) if path else None
        return self._modules[name]

    def source(self, name: str) -> str | None:
        """The text of module ``name`` (None when the tree has no such module)."""
        if name in self.replaced:
            return self.replaced[name]
        path = self._path(name)
        return path.read_text(encoding="utf-8") if path else None

    def _path(self, name: str) -> Path | None:
        parts = name.split(".")
        candidates = (self.root.joinpath(*parts).with_suffix(".py"), self.root.joinpath(*parts, "__init__.py"))
        return next((p for p in candidates if p.is_file()), None)

    def has_module(self, name: str) -> bool:
        return self.module(name) is not None

    def definition(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where ``name`` as seen from ``module`` is defined: ``(module, node)`` of a class, a function or an
        assignment at module level, following imports inside the tree; None if it is not there."""
        tree = self.module(module)
        if tree is None or depth > MAX_RE_EXPORTS:
            return None
        for node in _module_level(tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
            if _assigns(node, name):
                return module, node
        for node in _module_level(tree.body):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, node, self.is_package(module))
                        found = self.definition(source, alias.name, depth + 1)
                        if found is not None:
                            return found
        return None

    def class_info(self, module: str, name: str) -> ClassInfo | None:
        found = self.definition(module, name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return None
        return self._collect(found[0], found[1], depth=0)

    def _collect(self, module: str, node: ast.ClassDef, depth: int) -> ClassInfo:
        info = ClassInfo(module, node.name)
        for base in node.bases if depth <= MAX_RE_EXPORTS else ():
            base_name = _dotted_tail(base)
            found = self.definition(module, base_name) if base_name else None
            if found is not None and isinstance(found[1], ast.ClassDef):
                inherited = self._collect(found[0], found[1], depth + 1)
                info.methods.update(inherited.methods)
                info.method_modules.update(inherited.method_modules)
                info.attributes |= inherited.attributes
                info.fields += [f for f in inherited.fields if f not in info.fields]
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                info.methods[item.name] = item
                info.method_modules[item.name] = module
                info.attributes |= _self_assignments(item)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                info.attributes.add(item.target.id)
                if not _is_class_var(item.annotation) and item.target.id not in info.fields:
                    info.fields.append(item.target.id)
            elif isinstance(item, ast.Assign):
                info.attributes |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        return info

    def is_package(self, module: str) -> bool:
        return self.root.joinpath(*module.split("."), "__init__.py").is_file()


# CPython 3.11's ast.parse is not safe in two threads at once: it raised "SystemError: AST constructor recursion
# depth mismatch" when the two actors of an inline run (apps/inline_run.py) checked their engine's API together.
_PARSE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=256)
def _parsed(path: str, mtime_ns: int) -> ast.Module:
    """A module file parsed once per process (and per change of the file): the check at engine start and the
    tests read the same few dozen modules of the installed vLLM again and again. Trees are never modified."""
    source = Path(path).read_text(encoding="utf-8")
    with _PARSE_LOCK:
        return ast.parse(source)


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Parameters:
    """The names a call can pass by keyword or position, without ``self``/``cls`` (``staticmethod``s keep all)."""
    args = function.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    static = any(_dotted_tail(d) == "staticmethod" for d in function.decorator_list)
    if names and not static and names[0] in ("self", "cls"):
        names = names[1:]
    names += [a.arg for a in args.kwonlyargs]
    return Parameters(tuple(names), args.kwarg is not None)


def forwarded_parameters(tree: SourceTree, module: str, function: ast.FunctionDef | ast.AsyncFunctionDef,
                         depth: int = 0) -> Parameters | None:
    """What a method that takes ``**kwargs`` accepts when it passes them on to the method of the same name of a
    class it names (``OtherRunner.reload_weights(self, *args, **kwargs)``, the class imported in the method or
    its module): that method's parameters; None when it does not, or the class is not in the tree."""
    local = {alias.asname or alias.name: (node, alias.name) for node in ast.walk(function)
             if isinstance(node, ast.ImportFrom) for alias in node.names}
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == function.name and isinstance(node.func.value, ast.Name)
                and any(keyword.arg is None for keyword in node.keywords)):
            continue
        owner = node.func.value.id
        if owner in local:
            imported, real = local[owner]
            info = tree.class_info(_absolute(module, imported, tree.is_package(module)), real)
        else:
            info = tree.class_info(module, owner)
        target = info.methods.get(function.name) if info is not None else None
        if target is None or target is function:
            continue
        accepted = parameters(target)
        if accepted.any_keyword and depth < MAX_RE_EXPORTS:
            return forwarded_parameters(tree, info.method_modules[function.name], target, depth + 1) or accepted
        return accepted
    return None


def constructor_parameters(info: ClassInfo) -> Parameters:
    """What ``Class(...)`` accepts: its (or a base's) ``__init__``, else its annotated fields (a dataclass,
    a msgspec struct, a TypedDict)."""
    init = info.methods.get("__init__")
    if init is not None:
        return parameters(init)
    return Parameters(tuple(info.fields), False)


def literal_values(tree: SourceTree, module: str, name: str) -> tuple[str, ...] | None:
    """The strings of a module-level ``Name = Literal["a", "b", ...]``; None when there is no such alias."""
    found = tree.definition(module, name)
    if found is None or not isinstance(found[1], (ast.Assign, ast.AnnAssign)) or found[1].value is None:
        return None
    return tuple(node.value for node in ast.walk(found[1].value)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str))


def string_constant_after(tree: SourceTree, module: str, call_argument: str) -> str | None:
    """The string constant passed right after ``call_argument`` in a call in ``module`` (for
    ``os.getenv("NAME", "0")``: the default ``"0"``), ``"None"`` for a ``None`` there; None when not found."""
    source = tree.module(module)
    if source is None:
        return None
    for node in ast.walk(source):
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            first, second = node.args[0], node.args[1]
            if isinstance(first, ast.Constant) and first.value == call_argument and isinstance(second, ast.Constant):
                return str(second.value)
    return None


def _module_level(body: list[ast.stmt]):
    """Statements at module level, including those inside ``if``/``try`` blocks (``TYPE_CHECKING``, fallbacks)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block)


def _assigns(node: ast.stmt, name: str) -> bool:
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    # an annotation alone (``x: int``) declares, it does not define
    return (isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name)
            and node.target.id == name)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The module a ``from ... import`` names: ``from .x import y`` in module a.b.c is a.b.x, in package a.b.c
    (its ``__init__.py``) a.b.c.x."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted_tail(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):  # Generic[T], SomeBase[...]
        return _dotted_tail(node.value)
    return ""


def _self_assignments(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for node in ast.walk(function):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for leaf in ast.walk(target):
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                        and leaf.value.id == "self"):
                    names.add(leaf.attr)
    return names


def _is_class_var(annotation: ast.expr) -> bool:
    return _dotted_tail(annotation) == "ClassVar"
