"""What a causal LM's own `forward` does around its loss, read from the family's code: the one place cpbench reads a
family's source (and its declared router recorders) rather than calling it.

cpbench replaces a model's loss (the whole-sequence loss under CP; the chunked and Liger losses, which never build the
full logits), so it must redo what the family's forward does between its output projection and the loss, and the
router auxiliary loss an MoE family adds. Families differ in small ways: cohere multiplies the logits by
`logit_scale`, granite divides them by `config.logits_scaling`, gemma soft-caps them, phi's projection has a bias;
jetmoe names its aux coefficient `aux_loss_coef`, doge's aux loss takes another argument. A table of families would
silently outgrow a new transformers release, so the forward's statements are matched against the forms cpbench
reproduces exactly, and whatever does not match is returned as `unknown` (the statement), for the caller to refuse
by name. The forms are read once per class; the values they name (`self.logit_scale`, `self.num_experts`) are read
from the model at each forward.

Touch points with transformers internals (beside hf_compat's): the source of a causal LM's `forward` and of its
module's `load_balancing_loss_func`, and a base model's `_can_record_outputs` (its `OutputRecorder`s' fields).
Tested against transformers 5.23: tests/unit/test_head_transforms.py classifies every causal-LM class it ships.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

LOAD_BALANCING = "load_balancing_loss_func"
TANH = {"torch.tanh", "nn.functional.tanh", "F.tanh", "torch.nn.functional.tanh"}
NO_OPS = {"float", "contiguous"}  # the chunked and Liger losses make fp32 logits of their own
SCALAR_CALLS = {"get_text_config"}  # zero-argument methods a scalar may go through (gemma3n/gemma4's config)


@dataclass(frozen=True)
class HeadForm:
    """The forward's logits after the output projection `self.<head>`: `steps`, each ("mul" | "div", scalar),
    ("tanh", None), ("let", name, scalar) or ("if_set", scalar, steps); or `unknown`, the statement not understood."""

    steps: tuple = ()
    unknown: str | None = None

    def ops(self, model) -> tuple[tuple[str, object], ...]:
        """The elementwise ops on the logits, in order, with this model's values: ("mul", v), ("div", v), ("tanh",
        None)."""
        out: list = []
        _run(self.steps, model, {}, out)
        return tuple(out)


@dataclass(frozen=True)
class RouterAuxForm:
    """`loss += coef * load_balancing_loss_func(outputs.router_logits, num_experts, top_k, attention_mask)`, the
    three scalars as the forward names them; or `unknown`, what differs from that form."""

    num_experts: ast.expr | None = None
    top_k: ast.expr | None = None
    coef: ast.expr | None = None
    unknown: str | None = None

    def values(self, model) -> tuple[int, int, float]:
        return tuple(_value(e, model, {}) for e in (self.num_experts, self.top_k, self.coef))


class _NotUnderstood(Exception):
    pass


@functools.cache
def _forward(cls) -> tuple[object, ast.FunctionDef | None]:
    fn = inspect.unwrap(cls.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):  # no source (a class made at run time): nothing can be matched
        return fn, None
    return fn, tree.body[0]


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _scalar(node: ast.expr, names: set[str]) -> bool:
    """A value read from the model (`self.a.b`, `self.config.get_text_config().c`), a constant or a bound name."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute):
        return (isinstance(node.value, ast.Name) and node.value.id == "self") or _scalar(node.value, names)
    if isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute):
        return node.func.attr in SCALAR_CALLS and _scalar(node.func.value, names)
    if isinstance(node, ast.NamedExpr):
        return _scalar(node.value, names)
    return False


def _value(node: ast.expr, model, env: dict):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return model if node.id == "self" else env[node.id]
    if isinstance(node, ast.Attribute):
        return getattr(_value(node.value, model, env), node.attr)
    if isinstance(node, ast.Call):
        return _value(node.func, model, env)()
    if isinstance(node, ast.NamedExpr):
        env[node.target.id] = value = _value(node.value, model, env)
        return value
    raise AssertionError(ast.dump(node))  # _scalar admitted only the forms above


def _run(steps, model, env: dict, out: list) -> None:
    for step in steps:
        if step[0] == "let":
            env[step[1]] = _value(step[2], model, env)
        elif step[0] == "if_set":
            if _value(step[1], model, env) is not None:
                _run(step[2], model, env, out)
        else:
            out.append((step[0], None if step[1] is None else _value(step[1], model, env)))


def _calls(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Call) and _dotted(node.func) == f"self.{attr}"


def _logit_ops(node: ast.expr, var: str | None, head: str, names: set[str]) -> list:
    """The elementwise ops `node` applies to the logits: to the head's output (`var` None) or to `var`."""
    if (_calls(node, head) if var is None else isinstance(node, ast.Name) and node.id == var):
        return []
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        kind = "mul" if isinstance(node.op, ast.Mult) else "div"
        if _scalar(node.right, names):
            return [*_logit_ops(node.left, var, head, names), (kind, node.right)]
        if kind == "mul" and _scalar(node.left, names):
            return [*_logit_ops(node.right, var, head, names), (kind, node.left)]
    if isinstance(node, ast.Call) and not node.keywords:
        if _dotted(node.func) in TANH and len(node.args) == 1:
            return [*_logit_ops(node.args[0], var, head, names), ("tanh", None)]
        if isinstance(node.func, ast.Attribute) and node.func.attr in NO_OPS and not node.args:
            return _logit_ops(node.func.value, var, head, names)
    raise _NotUnderstood(ast.unparse(node))


def _assigns(stmt: ast.stmt, var: str) -> bool:
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == var)


def _if_set(stmt: ast.stmt, names: set[str]) -> ast.expr | None:
    """`x` of `if x is not None:` (no else) where x is a scalar, else None."""
    if not isinstance(stmt, ast.If) or stmt.orelse or not isinstance(test := stmt.test, ast.Compare):
        return None
    if (len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None and _scalar(test.left, names)):
        return test.left
    return None


def _step(stmt: ast.stmt, var: str, head: str, names: set[str]) -> list | None:
    """The steps of one statement after the projection, or None where the logits' statements end."""
    if _assigns(stmt, var):
        return _logit_ops(stmt.value, var, head, names)
    if (cond := _if_set(stmt, names)) is not None and all(_assigns(s, var) for s in stmt.body):
        if isinstance(cond, ast.NamedExpr):
            names.add(cond.target.id)
        return [("if_set", cond, tuple(op for s in stmt.body for op in _logit_ops(s.value, var, head, names)))]
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
            and _scalar(stmt.value, names):  # e.g. recurrent_gemma's `cap = self.config.logits_soft_cap`
        names.add(stmt.targets[0].id)
        return [("let", stmt.targets[0].id, stmt.value)]
    return None


@functools.cache
def head_form(cls, head: str) -> HeadForm:
    """How `cls.forward` turns the output of its projection `self.<head>` into the logits its loss reads."""
    _, fn = _forward(cls)
    if fn is None:
        return HeadForm(unknown=f"the source of {cls.__name__}.forward (not readable)")
    body = fn.body
    first = next((i for i, s in enumerate(body) if any(_calls(n, head) for n in ast.walk(s))), None)
    call = body[first] if first is not None else None
    if not (isinstance(call, ast.Assign) and len(call.targets) == 1 and isinstance(call.targets[0], ast.Name)):
        return HeadForm(unknown=ast.unparse(call).splitlines()[0] if call is not None else f"no call of self.{head}")
    var, names, at = body[first].targets[0].id, set(), first  # at: the statement being read
    try:
        steps = _logit_ops(body[first].value, None, head, names)
        for at in range(first + 1, len(body)):
            if (more := _step(body[at], var, head, names)) is None:
                break
            steps += more
        else:
            at = len(body)
    except _NotUnderstood:
        return HeadForm(unknown=ast.unparse(body[at]).splitlines()[0])
    for stmt in body[at:]:  # the logits must reach the loss as they are now
        if any(isinstance(n, ast.Name) and n.id == var and isinstance(n.ctx, ast.Store) for n in ast.walk(stmt)):
            return HeadForm(unknown=ast.unparse(stmt).splitlines()[0])
    return HeadForm(steps=tuple(steps))


def _without_docstring(fn) -> str:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
        tree.body = tree.body[1:]
    return ast.dump(tree)


@functools.cache
def _switch_form() -> str:
    """The load-balancing loss cpbench reproduces (router.py): transformers' Switch-Transformer form, as mixtral's
    modeling module defines it (one copy of it per family)."""
    from transformers.models.mixtral import modeling_mixtral

    return _without_docstring(modeling_mixtral.load_balancing_loss_func)


@functools.cache
def router_aux_form(cls) -> RouterAuxForm | None:
    """The router auxiliary loss `cls.forward` adds to its loss; None when it calls no `load_balancing_loss_func`."""
    fn, tree = _forward(cls)
    if tree is None:
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _dotted(n.func) == LOAD_BALANCING]
    if not calls:
        return None
    own = fn.__globals__.get(LOAD_BALANCING)
    if own is None or _without_docstring(own) != _switch_form():
        return RouterAuxForm(unknown=f"its {LOAD_BALANCING} is not mixtral's")
    call = calls[0]
    args = call.args
    if (len(calls) != 1 or len(args) != 4 or call.keywords or _dotted(args[0]) != "outputs.router_logits"
            or _dotted(args[3]) != "attention_mask" or not _scalar(args[1], set()) or not _scalar(args[2], set())):
        return RouterAuxForm(unknown=ast.unparse(call))
    coefs = [n.value.left for n in ast.walk(tree) if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add)
             and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Mult)
             and "aux_loss" in ast.unparse(n.value.right) and _scalar(n.value.left, set())]
    if len(coefs) != 1:
        return RouterAuxForm(unknown="the statement that adds `coef * aux_loss` to the loss")
    return RouterAuxForm(num_experts=args[1], top_k=args[2], coef=coefs[0])


def router_recorders(base_model) -> list[tuple[type | None, str | None, str | None, int]]:
    """Where transformers records `router_logits` in `base_model` (its `_can_record_outputs`, as
    transformers.utils.output_capturing reads it): (class, class-name suffix, layer name, output index) each."""
    specs = (getattr(base_model, "_can_record_outputs", None) or {}).get("router_logits")
    if specs is None:
        return []
    out = []
    for spec in specs if isinstance(specs, list) else [specs]:
        if hasattr(spec, "target_class"):  # an OutputRecorder
            out.append((spec.target_class, spec.class_name, spec.layer_name, spec.index))
        else:  # a bare class or class name: transformers takes output 1 of it
            out.append((None, spec, None, 1) if isinstance(spec, str) else (spec, None, None, 1))
    return out
