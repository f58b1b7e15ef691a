"""The wrap idiom lives once: integrations/wrap.py (issue 31).

"Replace a host attribute by a wrapper, keep and mark the original, install once, restore on
uninstall" used to be written out by hand in every seam. A hand-written copy shows itself by
one of two things, and this test looks for both with ``ast``:

- a mark: a ``__cppo_*__`` attribute name, a write to ``__wrapped__``, an ``_cppo_installed``
  style flag or a module-level dict of originals (anywhere in the package);
- a by-hand replacement: within one function, an attribute of some object is read and then
  that same attribute is written with something made from what was read (a wrapper around it,
  a closure over it, or the saved value put back). Checked in ``integrations/``, where the
  seams live; the layers inside it (trainer, megatron, rollout) cannot import
  ``integrations.wrap`` (design.md: dependencies point inward).

Cost: parses ~60 files, well under a second.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "cppo_megatron"
HELPER = PKG / "integrations" / "wrap.py"
SEAMS = PKG / "integrations"
# the import hook hands each watched module's fresh spec a loader around the finder's one: a new
# object per import, nothing installed on a host, nothing to restore
IMPORT_HOOK = PKG / "integrations" / "importhook.py"
# value conversions: what they return is a number or a copy, not a wrapper
_CONVERSIONS = {"int", "float", "str", "bool", "len", "list", "tuple", "dict", "set", "sorted", "round", "abs"}

_MARK_NAME = re.compile(r"^__cppo\w*__$|^_+cppo_(installed|patched|wrapped|orig\w*)_*$")
_ORIGINALS = re.compile(r"(?i)^_*orig(inal)?s?(_\w*)?$")


def marks(source: str, filename: str = "<src>") -> list[str]:
    """``line: what`` for each mark of a hand-written wrap in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _MARK_NAME.match(node.value):
            out.append(f"{node.lineno}: mark name {node.value!r}")
        elif isinstance(node, ast.Attribute) and _MARK_NAME.match(node.attr):
            out.append(f"{node.lineno}: mark attribute .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "__wrapped__" and isinstance(node.ctx, ast.Store):
            out.append(f"{node.lineno}: writes .__wrapped__")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value == "__wrapped__"):
            out.append(f"{node.lineno}: setattr(..., '__wrapped__', ...)")
    for node in ast.parse(source).body:  # module-level stores of originals
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            if isinstance(t, ast.Name) and _ORIGINALS.match(t.id):
                out.append(f"{node.lineno}: module-level store of originals {t.id!r}")
    return out


def _slot(owner: ast.expr, key: ast.expr | str) -> tuple[str, str] | None:
    """(owner, attribute) as source text; None for ``self`` (an instance's own state)."""
    o = ast.unparse(owner)
    if o in ("self", "cls.__dict__"):
        return None
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        key = key.value
    return o, key if isinstance(key, str) else ast.unparse(key)


def _read_slot(node: ast.AST) -> tuple[str, str] | None:
    """The attribute slot ``node`` reads: ``X.a``, ``getattr(X, k)``, ``X.__dict__[k]``,
    ``X.__dict__.get(k)``, ``inspect.getattr_static(X, k)``."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr != "__dict__":
        return _slot(node.value, node.attr)
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in ("getattr", "getattr_static") and len(node.args) >= 2:
            return _slot(node.args[0], node.args[1])
        if (name == "get" and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute)
                and f.value.attr == "__dict__" and node.args):
            return _slot(f.value.value, node.args[0])
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__":
        return _slot(node.value.value, node.slice)
    return None


def _carries(node: ast.AST, tainted: set[str], slot: tuple[str, str]) -> bool:
    """``node`` evaluates to the value of ``slot`` or to something built around it: the value
    itself, a name it was saved under, a call that is handed it (a wrapper factory), a container
    or an item of one holding it. Arithmetic on it (a counter, a size) is not a wrapper."""
    if isinstance(node, ast.Name):
        return node.id in tainted
    if _read_slot(node) == slot:
        return True
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id in _CONVERSIONS:
            return False
        return any(_carries(a, tainted, slot) for a in [*node.args, *(k.value for k in node.keywords)])
    if isinstance(node, (ast.Tuple, ast.List)):
        return any(_carries(e, tainted, slot) for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(_carries(v, tainted, slot) for v in node.values)
    if isinstance(node, ast.Subscript):
        return _carries(node.value, tainted, slot)
    return False


def _calls(fn: ast.AST, tainted: set[str], slot: tuple[str, str]) -> bool:
    """``fn`` (a nested function) calls the saved value: a closure over the original."""
    return any(isinstance(c, ast.Call) and _carries(c.func, tainted, slot) for c in ast.walk(fn))


def replacements(source: str, filename: str = "<src>") -> list[str]:
    """``line: owner.attr`` for each host attribute replaced by hand in ``source``."""
    out = []
    for fn in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes = sorted((n for n in ast.walk(fn) if hasattr(n, "lineno") and n is not fn),
                       key=lambda n: (n.lineno, n.col_offset))
        read = {s for n in nodes if (s := _read_slot(n)) is not None}
        for slot in read:
            tainted: set[str] = set()
            for n in nodes:
                if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None and _carries(
                        n.value, tainted, slot):
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                        tainted |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _calls(n, tainted, slot):
                    tainted.add(n.name)
                write = None
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        if isinstance(t, ast.Attribute) and _slot(t.value, t.attr) == slot:
                            write = n.value
                elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr"
                      and len(n.args) == 3 and _slot(n.args[0], n.args[1]) == slot):
                    write = n.args[2]
                if write is not None and _carries(write, tainted, slot):
                    out.append(f"{n.lineno}: {slot[0]}.{slot[1]}")
    return sorted(set(out), key=lambda s: int(s.split(":")[0]))


def _package_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if p != HELPER)


def test_no_hand_written_mark_outside_the_helper():
    files = _package_files()
    assert len(files) > 100 and (SEAMS / "verl" / "hook.py") in files
    bad = [f"{p.relative_to(PKG.parent)}:{hit}" for p in files for hit in marks(p.read_text(), str(p))]
    assert bad == [], ("wrap host attributes with cppo_megatron.integrations.wrap (wrap / unwrap / original / "
                       "wrapped), not by hand:\n" + "\n".join(bad))


def test_no_hand_written_replacement_in_the_seams():
    files = [p for p in _package_files() if SEAMS in p.parents and p != IMPORT_HOOK]
    assert len(files) > 40
    bad = [f"{p.relative_to(PKG.parent)}:{hit}" for p in files for hit in replacements(p.read_text(), str(p))]
    assert bad == [], ("these functions replace a host attribute by hand; use cppo_megatron.integrations.wrap "
                       "(wrap, or wrapped for a with block):\n" + "\n".join(bad))


# the shapes the seams had before the helper (one per kind): each must be found
_HAND_WRITTEN = {
    "mark on the wrapper": '''
_MARK = "__cppo_clock__"
def _patch(module):
    cls = module.Trainer
    current = cls.__dict__.get("_get_gen_batch")
    if not hasattr(current, _MARK):
        wrapped = _wrap(current)
        setattr(wrapped, _MARK, current)
        cls._get_gen_batch = wrapped
''',
    "wrapped and flag": '''
def install(maker_class):
    if getattr(maker_class, "_cppo_installed", False):
        return
    make_batch = maker_class.make_experience_batch
    def make_experience_batch(self, samples):
        return make_batch(self, samples)
    fn = torch.no_grad()(make_experience_batch)
    fn.__wrapped__ = make_batch
    setattr(maker_class, "make_experience_batch", fn)
    maker_class._cppo_installed = True
''',
    "originals dict": '''
_ORIGINALS: dict = {}
def install(cls):
    _ORIGINALS["m"] = cls.m
''',
}
_BY_HAND = {
    "wrapper of the read": ('''
def patch(module):
    current = getattr(module, "set_random_seed", None)
    if current is not None:
        module.set_random_seed = _cpu_set_random_seed(current)
''', ["5: module.set_random_seed"]),
    "loop with setattr": ('''
def patch(cls):
    for name in dir(cls):
        static = inspect.getattr_static(cls, name)
        setattr(cls, name, _in_mode(static))
''', ["5: cls.name"]),
    "swap for a block": ('''
def timed(phases):
    original = ray.init
    def init(*args, **kwargs):
        return original(*args, **kwargs)
    ray.init = init
    try:
        yield
    finally:
        ray.init = original
''', ["6: ray.init", "10: ray.init"]),
}
_FINE = '''
def patch(module):
    wrap(module.Trainer, "_get_gen_batch", _legacy_gen_batch, tag=WRAP_TAG)
    _local.depth = getattr(_local, "depth", 0) + 1
    self.step = self.step + 1
    mod.set_device = _noop
    verl_main.__wrapped__(config)
'''


def test_the_search_finds_each_hand_written_shape():
    for what, src in _HAND_WRITTEN.items():
        assert marks(src), what
    assert len(marks(_HAND_WRITTEN["wrapped and flag"])) == 3  # the flag (read and write) and __wrapped__
    for what, (src, want) in _BY_HAND.items():
        assert replacements(src) == want, what
    assert marks(_FINE) == [] and replacements(_FINE) == []
