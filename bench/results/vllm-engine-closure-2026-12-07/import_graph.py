"""The import graph of vLLM modules, read from their syntax trees: module-level imports (``top``),
those under a module-level ``if`` that is not a platform check (``cond``), inside ``try``
(``try``) and inside functions (``lazy``), followed through ``vllm.*`` modules and their parent
packages. ``if TYPE_CHECKING`` is left out; platform checks are evaluated for CUDA (``PLATFORM``).

    python import_graph.py $(python scripts/vllm_sources.py 0.34.0) vllm.entrypoints.llm ... > graph.json

Writes JSON: each module reached (how, and one chain of importers), each external module with
the places importing it by kind, and the function-level ``vllm`` imports.
"""
import ast, sys, json
from pathlib import Path

SRC = Path(sys.argv[1])
roots = sys.argv[2:]

def path_of(mod):
    p = SRC / Path(*mod.split("."))
    if (p / "__init__.py").exists(): return p / "__init__.py"
    if p.with_suffix(".py").exists(): return p.with_suffix(".py")
    return None

def is_pkg(mod):
    return (SRC / Path(*mod.split(".")) / "__init__.py").exists()

def type_checking(node):
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")

PLATFORM = {"is_cuda": True, "is_cuda_alike": True, "is_rocm": False, "is_xpu": False,
            "is_cpu": False, "is_tpu": False, "is_out_of_tree": False}

def evaluate(t):
    """True/False for conditions on the platform (CUDA), None if unknown."""
    if isinstance(t, ast.Call) and isinstance(t.func, ast.Attribute) and t.func.attr in PLATFORM \
            and not t.args:
        return PLATFORM[t.func.attr]
    if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
        v = evaluate(t.operand)
        return None if v is None else not v
    if isinstance(t, ast.BoolOp):
        vs = [evaluate(v) for v in t.values]
        if isinstance(t.op, ast.And):
            if False in vs: return False
            return True if all(v is True for v in vs) else None
        if True in vs: return True
        return False if all(v is False for v in vs) else None
    return None

def walk(mod):
    """(kind, module, lineno) for each import in mod; kind in top/try/lazy."""
    f = path_of(mod)
    tree = ast.parse(f.read_text(), str(f))
    out = []
    def visit(node, kind, in_func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and type_checking(child):
                for c in child.orelse: visit_one(c, kind, in_func)
                continue
            visit_one(child, kind, in_func)
    def visit_one(child, kind, in_func):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            visit(child, "lazy", True); return
        if isinstance(child, ast.Try):
            for c in child.body: visit_one(c, "lazy" if in_func else "try", in_func)
            for h in child.handlers: visit(h, "lazy" if in_func else "try", in_func)
            for c in child.orelse + child.finalbody: visit_one(c, kind, in_func)
            return
        if isinstance(child, ast.If) and type_checking(child):
            for c in child.orelse: visit_one(c, kind, in_func)
            return
        if isinstance(child, ast.If) and not in_func:
            v = evaluate(child.test)
            c_kind = "cond" if kind == "top" else kind
            if v is True:
                for c in child.body: visit_one(c, kind, in_func)
            elif v is False:
                for c in child.orelse: visit_one(c, kind, in_func)
            else:
                for c in child.body + child.orelse: visit_one(c, c_kind, in_func)
            return
        if isinstance(child, ast.Import):
            for a in child.names: out.append((kind, a.name, child.lineno))
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                base = mod.split(".")
                if not is_pkg(mod): base = base[:-1]
                base = base[: len(base) - (child.level - 1)]
                m = ".".join(base + ([child.module] if child.module else []))
            else:
                m = child.module
            out.append((kind, m, child.lineno))
            for a in child.names:
                sub = f"{m}.{a.name}"
                if m.startswith("vllm") and path_of(sub):
                    out.append((kind, sub, child.lineno))
        visit(child, kind, in_func)
    visit(tree, "top", False)
    return out

seen = {}  # module -> (how reached: 'top'/'try', parent)
ext = {}   # external top name -> {kind: [(mod, line)]}
lazy_vllm = {}
queue = [(r, "top", None) for r in roots]
while queue:
    mod, kind, parent = queue.pop()
    rank = {"top": 0, "cond": 1, "try": 2, "lazy": 3}
    if mod in seen and rank[seen[mod][0]] <= rank[kind]:
        continue
    seen[mod] = (kind, parent)
    # parent packages run their __init__
    parts = mod.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if True:
            queue.append((pkg, kind, mod))
    if path_of(mod) is None:
        continue
    for k, m, line in walk(mod):
        rank = {"top": 0, "cond": 1, "try": 2, "lazy": 3}
        eff = max(kind, k, key=rank.get)
        if m.split(".")[0] == "vllm":
            if eff == "lazy":
                lazy_vllm.setdefault(m, []).append(f"{mod}:{line}")
            elif path_of(m) is not None or is_pkg(m):
                queue.append((m, eff, mod))
            else:
                # compiled module or missing
                ext.setdefault(m, {}).setdefault(eff, []).append(f"{mod}:{line}")
        else:
            ext.setdefault(m.split(".")[0], {}).setdefault(eff, []).append(f"{mod}:{line}")
        if eff == "lazy" and m.split(".")[0] == "vllm" and path_of(m) is None:
            ext.setdefault(m, {}).setdefault("lazy", []).append(f"{mod}:{line}")

def chain(mod):
    c = [mod]
    while seen.get(c[-1], (None, None))[1]:
        c.append(seen[c[-1]][1])
        if len(c) > 30: break
    return " <- ".join(c)

json.dump({"modules": {m: {"kind": v[0], "chain": chain(m)} for m, v in seen.items()},
           "external": ext, "lazy_vllm": lazy_vllm}, open(sys.stdout.fileno(), "w"), indent=1)
