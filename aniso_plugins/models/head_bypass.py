"""Whether a model's forward computes its loss from its LM head's weight without calling the head
module (`head_bypass_in_forward`), read from the forward's code (its syntax tree), as TRL's,
Liger-Kernel's (``apply_liger_kernel_to_*``'s ``lce_forward``), Cut Cross-Entropy's
(``cce_patch``) and Axolotl's patched forwards do: they pass ``lm_head.weight`` to a fused
kernel of their own. A method that acts in the head's forward (AGG's gated head, a regularizer
attached to the head's output, the fused loss) would then silently do nothing."""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap

from torch import nn

__all__ = ["head_bypass_in_forward"]


_INSPECTING = frozenset({"isinstance", "issubclass", "getattr", "hasattr", "type", "id", "len", "repr", "str", "print"})
"""Builtins that look at the head without computing with it."""


def _forward_functions(model: nn.Module) -> list:
    """The functions behind ``model.forward`` (an instance patch, else the class's): the function
    and each one it wraps (``functools.wraps``' ``__wrapped__``: a decorator's wrapper, or a patch
    that copies the forward's signature, as TRL's)."""
    forward = model.__dict__.get("forward", type(model).forward)
    function = getattr(forward, "__func__", forward)
    chain = [function]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 8:
        chain.append(chain[-1].__wrapped__)
    return chain


def _source(function) -> str | None:
    """The code of `function` itself (not of what it wraps, which ``inspect.getsource`` reads)."""
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    lines = linecache.getlines(code.co_filename)
    if not lines:
        return None
    return textwrap.dedent("".join(inspect.getblock(lines[code.co_firstlineno - 1 :])))


def _head_expression(node: ast.AST, attribute: str, heads: set[str]) -> bool:
    """Whether `node` is the head module: ``self.<attribute>``, ``self.get_output_embeddings()``
    or a name bound to one of them."""
    if isinstance(node, ast.Name):
        return node.id in heads
    if isinstance(node, ast.Attribute):
        return node.attr == attribute and isinstance(node.value, ast.Name) and node.value.id == "self"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_output_embeddings"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")


def _bound_names(tree: ast.AST, attribute: str) -> tuple[set[str], set[str]]:
    """(names bound to the head module, names bound to its weight), from plain and tuple assignments."""
    heads: set[str] = set()
    weights: set[str] = set()
    for _ in range(2):  # a weight name may come from a head name bound earlier
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            pairs = []
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts))
                else:
                    pairs.append((target, node.value))
            for target, value in pairs:
                if not isinstance(target, ast.Name):
                    continue
                if _head_expression(value, attribute, heads):
                    heads.add(target.id)
                elif _is_weight(value, attribute, heads, set()):
                    weights.add(target.id)
    return heads, weights


_SAME_VALUES = frozenset({"T", "mT", "data"})
"""Attributes of a tensor that are its values (transposed): the weight handed on all the same."""
_SAME_VALUE_CALLS = frozenset({"t", "to", "float", "half", "bfloat16", "contiguous", "type"})


def _is_weight(node: ast.AST, attribute: str, heads: set[str], weights: set[str]) -> bool:
    """Whether `node` is the head's weight, also transposed or cast (``lm_head.weight.T``,
    ``.to(dtype)``); not one of its attributes (``lm_head.weight.dtype``)."""
    while True:
        if isinstance(node, ast.Attribute) and node.attr in _SAME_VALUES:
            node = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _SAME_VALUE_CALLS):
            node = node.func.value
        else:
            break
    if isinstance(node, ast.Name):
        return node.id in weights
    return isinstance(node, ast.Attribute) and node.attr == "weight" and _head_expression(node.value, attribute, heads)


def head_bypass_in_forward(model: nn.Module, attribute: str) -> str | None:
    """What in `model`'s forward hands its LM head (``self.<attribute>``, or
    ``self.get_output_embeddings()``) or the head's weight to another function
    (a fused loss kernel) rather than calling the head, or None (it does not, or its code cannot
    be read). Followed into module-level functions the forward calls with ``self`` (Liger-Kernel's
    ``lce_maybe_trainable_lm_head(self, ...)``), two levels deep. Reading the weight's attributes
    (``lm_head.weight.dtype``) is not a bypass."""
    for function in _forward_functions(model):
        found = _bypass(function, attribute, type(model).__name__, depth=2)
        if found is not None:
            return found
    return None


def _bypass(function, attribute: str, model_name: str, depth: int) -> str | None:
    try:
        tree = ast.parse(_source(function) or "")
    except (SyntaxError, ValueError):
        return None
    name = attribute or "the LM head"
    heads, weights = _bound_names(tree, attribute)
    code = function.__code__  # its own names (functools.wraps gives a wrapper the wrapped one's)
    where = f"{getattr(function, '__globals__', {}).get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (isinstance(node.func, ast.Name) and node.func.id in _INSPECTING):
            continue
        arguments = [*node.args, *(k.value for k in node.keywords)]
        for arg in arguments:
            if _is_weight(arg, attribute, heads, weights) or _head_expression(arg, attribute, heads):
                what = f"{name}.weight" if _is_weight(arg, attribute, heads, weights) else name
                return (f"{model_name}'s forward ({where}) hands {what} to {ast.unparse(node.func)}(...) instead of "
                        f"calling {name}")
        helper = _helper(function, node) if depth > 0 and any(_is_self(a) for a in arguments) else None
        found = None if helper is None else _bypass(helper, attribute, model_name, depth - 1)
        if found is not None:
            return found
    return None


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _helper(function, call: ast.Call):
    """The module-level Python function a call by plain name resolves to in `function`'s globals, or None."""
    if not isinstance(call.func, ast.Name):
        return None
    found = getattr(function, "__globals__", {}).get(call.func.id)
    return found if inspect.isfunction(found) else None
