"""The text a learner follows, read as code (used by ``tests/test_exercise_text.py``).

An exercise tells the learner which names to use -- in its markdown's inline code (```plan.add(seq, n)```),
in its stub's signatures and in its check's hints. :func:`problems` parses each such fragment and
resolves every name in it against what the learner's code can reach: the notebook's imports before
the exercise, the objects the text calls by name (``self``, ``seq``, ``plan``... -- real ones, taken
from a running engine), the names the text itself binds (``output = self.make_output(plan)``), and
what the learner writes (the stub's functions and their parameters). A call must accept the
arguments it is written with (``inspect.signature(...).bind``); a function the learner is told to
write (``update_from_output(self, scheduler_output, output, now)``) must have exactly those
parameters in the stub, and as many as the method it overrides.

Nothing is called except a dataclass with no arguments (``StepPlan()``). Fragments that are not
Python (``c .. c + n - 1``, ``<= now``) are prose and skipped; a bare name that resolves nowhere is a
learner's local or a symbol of the prose (``L``, ``t``) unless it looks like an API name
(snake_case), which must exist.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass, field

SPAN = re.compile(r"`([^`\n]+)`")
# In a hint's prose: a call (``self.make_output(plan)``), perhaps assigned (``output = self.make_output(plan)``).
CALL = re.compile(r"(?:\b[A-Za-z_]\w* = )?(?:super\(\)\.)?\b[A-Za-z_][\w.]*\([^()]*\)")
UNKNOWN = object()  # a value the check cannot know without running the learner's code


class Unresolved(Exception):
    """A name the text tells the learner to use does not exist, or not with that signature."""


def code_spans(markdown: str) -> list[str]:
    """The inline code of ``markdown``, less file names and paths (``scheduler.py``, ``vllm/v1/``)."""
    return [s for s in SPAN.findall(markdown) if not re.search(r"/|\.(py|ipynb|md)$", s)]


def hint_fragments(text: str) -> list[str]:
    return CALL.findall(text)


def signature_of(node: ast.FunctionDef) -> list[str]:
    """A def's parameters as written: names, ``*args``, ``**kwargs`` (defaults dropped)."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args]
    names += [f"*{a.vararg.arg}"] if a.vararg else (["*"] if a.kwonlyargs else [])
    names += [p.arg for p in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    return names


def call_as_signature(node: ast.Call) -> list[str] | None:
    """``f(a, b, **kw)`` read as a signature, or None when an argument is not a plain name."""
    names = []
    for arg in node.args:
        if isinstance(arg, ast.Name):
            names.append(arg.id)
        elif isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
            names.append(f"*{arg.value.id}")
        else:
            return None
    for kw in node.keywords:
        if kw.arg is None and isinstance(kw.value, ast.Name):
            names.append(f"**{kw.value.id}")
        else:
            return None
    return names


def learner_defs(source: str) -> tuple[dict, set]:
    """What a solution or stub cell defines: ``{function or method name: parameters}``, and every
    other name it binds (assignments, parameters, attributes set on ``self``)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}, set()
    defs, names = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[node.name] = signature_of(node)
            names |= {p.lstrip("*") for p in signature_of(node)}
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return defs, names


@dataclass
class Scope:
    """What an exercise's learner can reach (see the module)."""

    namespace: dict  # the notebook's imports before the exercise
    objects: dict = field(default_factory=dict)  # the text's names for real objects: self, seq, plan, ...
    defs: dict = field(default_factory=dict)  # what the learner writes: name -> parameters (from the stub)
    overrides: dict = field(default_factory=dict)  # method name -> the base-class method it overrides
    written: set = field(default_factory=set)  # other names the learner's cells bind, and earlier cells'
    bound: dict = field(default_factory=dict)  # names the text binds, in reading order
    glossary: list = field(default_factory=list)  # objects whose fields a lone name in the prose may be
    course: object = None  # the cbteach package: a dotted reference (`Completion.field`) may start there

    def member(self, name: str):
        """``name`` as an attribute of a context object, or of one of their attributes (``allocate_slots``
        is ``self.kv_manager.allocate_slots``)."""
        for obj in self.objects.values():
            for owner in [obj, *(_attrs(obj))]:
                if _has(owner, name):
                    return getattr(owner, name, UNKNOWN)
        raise KeyError(name)


def _attrs(obj) -> list:
    out = []
    for name in dir(obj):
        if name.startswith("_"):
            continue
        try:
            value = inspect.getattr_static(obj, name)
        except AttributeError:
            continue
        if not callable(value) and not isinstance(value, (property, int, float, str, bool, type(None))):
            out.append(getattr(obj, name, None))
    return [o for o in out if o is not None]


def _has(obj, name: str) -> bool:
    if inspect.ismodule(obj):
        return hasattr(obj, name)  # a package's names may be imported when first used (PEP 562)
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True
    try:
        inspect.getattr_static(obj, name)
        return True
    except AttributeError:
        return False


def problems(fragment: str, scope: Scope) -> list[str]:
    """What is wrong with one fragment of exercise text (empty: every name in it exists as written)."""
    try:
        tree = ast.parse(fragment.strip())
    except SyntaxError:
        return []  # prose, not code
    found = []
    for stmt in tree.body:
        try:
            _statement(stmt, scope, whole=len(tree.body) == 1 and isinstance(stmt, ast.Expr))
        except Unresolved as err:
            found.append(f"`{fragment}`: {err}")
    return found


def _statement(stmt, scope: Scope, whole: bool) -> None:
    if isinstance(stmt, ast.Assign):
        value = _value(stmt.value, scope, soft=isinstance(stmt.value, ast.Name))  # `token_budget=budget`: prose
        for target in stmt.targets:
            _bind(target, value, scope)
    elif isinstance(stmt, ast.Return):
        if stmt.value is not None:
            _value(stmt.value, scope, soft=True)
    elif isinstance(stmt, ast.Expr):
        node = stmt.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in scope.defs:
            _signature(node, scope)
        elif whole and isinstance(node, ast.Name):
            _bare(node.id, scope)
        elif whole and _dotted(node):
            _reference(node, scope)
        else:
            _value(node, scope, soft=not isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)))


def _signature(node: ast.Call, scope: Scope) -> None:
    """``update_from_output(self, scheduler_output, output, now)``: a function the learner writes."""
    name, written = node.func.id, scope.defs[node.func.id]
    said = call_as_signature(node)
    if not said:
        return  # a call with values, or `name()` naming the function in prose: not a signature
    if said not in (written, written[1:]) or (said == written[1:] and written[:1] != ["self"]):
        raise Unresolved(f"the learner's {name} is written ({', '.join(written)}) in the stub, not ({', '.join(said)})")
    base = scope.overrides.get(name)
    if base is not None:
        want = [p for p in inspect.signature(base).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len([p for p in written if not p.startswith("*")]) != len(want):
            raise Unresolved(f"{name} overrides {base.__qualname__}{inspect.signature(base)}: the engine calls it "
                             f"with {len(want) - 1} arguments")


def _bind(target, value, scope: Scope) -> None:
    if isinstance(target, ast.Name):
        scope.bound[target.id] = scope.objects.get(target.id, value)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            _bind(t, UNKNOWN, scope)
    elif isinstance(target, ast.Attribute):
        owner = _value(target.value, scope)
        if owner is not UNKNOWN and not _has(owner, target.attr):
            raise Unresolved(f"{ast.unparse(target.value)} ({type(owner).__name__}) has no attribute {target.attr!r}")


def _dotted(node) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _reference(node, scope: Scope) -> None:
    """`Completion.num_cached_prompt_tokens`: a name the prose points at -- its root may be the course's
    (`cbteach.Completion`) rather than imported where the learner writes; what follows must exist."""
    root = node
    while isinstance(root, ast.Attribute):
        root = root.value
    try:
        _name(root.id, scope)
    except Unresolved:
        if scope.course is None or not hasattr(scope.course, root.id):
            raise
        scope = Scope({root.id: getattr(scope.course, root.id)})
    _value(node, scope)


def _bare(name: str, scope: Scope) -> None:
    """A lone name in backticks: a field, a method, a module, a parameter -- or a symbol of the prose."""
    try:
        _name(name, scope)
    except Unresolved:
        if any(_has(obj, name) for obj in scope.glossary):
            return  # a field of the course's objects, or a function of its modules
        if "_" in name.strip("_"):  # snake_case: an API name, it must exist
            raise


def _name(name: str, scope: Scope):
    for table in (scope.bound, scope.objects, scope.namespace):
        if name in table:
            return table[name]
    if name in scope.defs or name in scope.written:
        return UNKNOWN
    if hasattr(builtins, name):
        return getattr(builtins, name)
    try:
        return scope.member(name)
    except KeyError:
        raise Unresolved(f"nothing the learner's code can reach is called {name!r}") from None


def _value(node, scope: Scope, soft: bool = False):
    """Resolve an expression's names (``soft``: a bare unknown name is a learner's local)."""
    if isinstance(node, ast.Name):
        try:
            return _name(node.id, scope)
        except Unresolved:
            if soft:
                return UNKNOWN
            raise
    if isinstance(node, ast.Attribute):
        owner = _value(node.value, scope)
        if owner is UNKNOWN:
            return UNKNOWN
        if not _has(owner, node.attr):
            kind = owner.__name__ if isinstance(owner, type) else type(owner).__name__
            raise Unresolved(f"{ast.unparse(node.value)} ({kind}) has no attribute {node.attr!r}")
        return getattr(owner, node.attr, UNKNOWN)
    if isinstance(node, ast.Call):
        return _call(node, scope)
    if isinstance(node, ast.Subscript):
        owner = _value(node.value, scope, soft=isinstance(node.value, ast.Name))  # `x[:, None]`: prose
        if isinstance(owner, dict) and isinstance(node.slice, ast.Constant) and node.slice.value not in owner:
            raise Unresolved(f"{ast.unparse(node.value)} has no key {node.slice.value!r} (it has {sorted(owner)})")
        _value(node.slice, scope, soft=True)
        return owner[node.slice.value] if isinstance(owner, dict) and isinstance(node.slice, ast.Constant) else UNKNOWN
    if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
        for gen in node.generators:
            _value(gen.iter, scope, soft=True)
        return UNKNOWN
    if isinstance(node, ast.Constant):
        return node.value
    for child in ast.iter_child_nodes(node):  # operators, comparisons, displays: their operands
        if isinstance(child, ast.expr):
            _value(child, scope, soft=True)
    return UNKNOWN


def _check_types(node: ast.Call, callee, sig, values) -> None:
    """An argument the text names, whose object is known, must be of the class its parameter is
    annotated with (``self.update_after_schedule(plan)``: a plan is not the message)."""
    try:
        hints = typing.get_type_hints(callee)
        bound = sig.bind_partial(*values).arguments
    except Exception:  # noqa: BLE001 -- unresolvable annotations: nothing to compare
        return
    for (name, value), arg in zip(bound.items(), node.args):
        want = hints.get(name)
        if isinstance(want, type) and value is not UNKNOWN and not isinstance(value, want) and value is not None:
            raise Unresolved(f"{ast.unparse(node.func)} takes {name}: {want.__name__}, and {ast.unparse(arg)} is a "
                             f"{type(value).__name__}")


def _call(node: ast.Call, scope: Scope):
    if isinstance(node.func, ast.Call) and isinstance(node.func.func, ast.Name) and node.func.func.id == "super":
        return UNKNOWN
    callee = _value(node.func, scope, soft=False)
    values = [_value(arg.value if isinstance(arg, ast.Starred) else arg, scope, soft=True) for arg in node.args]
    for kw in node.keywords:
        _value(kw.value, scope, soft=True)
    if callee is UNKNOWN or not callable(callee):
        return UNKNOWN
    try:
        sig = inspect.signature(callee)
    except (TypeError, ValueError):
        return UNKNOWN  # a builtin without a signature
    args = [None] * sum(not isinstance(a, ast.Starred) for a in node.args)
    kwargs = {kw.arg: None for kw in node.keywords if kw.arg is not None}
    # `Engine(..., kv="paged")`, `Engine(prefix_caching=True)`, `admit()`: arguments left out on purpose
    elided = any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in node.args) or not node.args
    if not any(isinstance(a, ast.Starred) for a in node.args) and all(kw.arg for kw in node.keywords):
        try:
            (sig.bind_partial if elided else sig.bind)(*args, **kwargs)
        except TypeError as err:
            raise Unresolved(f"{ast.unparse(node.func)}{sig} cannot be called so ({err})") from None
        _check_types(node, callee, sig, values)
    if isinstance(callee, type) and dataclasses.is_dataclass(callee) and not args and not kwargs:
        return callee()
    return UNKNOWN
