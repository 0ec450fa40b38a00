"""The training loss of a transformers causal LM, reproduced from the LM head's fused loss.

A causal LM that follows transformers' conventions (GPT-2, Llama, Qwen2, Mistral, Gemma, Phi,
OPT, GPT-NeoX, Falcon in transformers 5) computes in its forward

    logits = self.lm_head(hidden_states)                            (after logits_to_keep)
    loss = self.loss_function(logits, labels, vocab_size, **kwargs)  (ForCausalLMLoss)

and passes ``logits`` on unchanged. ForCausalLMLoss is Σ_{i: y_i ≠ −100} CE_i / D over the
shifted labels (or ``shift_labels``), D = ``num_items_in_batch`` when the Trainer passes it,
else the number of non-ignored targets (docs/methods.md §16). `why_loss_is_not_reproduced`
reads the forward's code (its syntax tree) for exactly that flow; `install_fused_causal_loss`
then makes ``model.loss_function`` take the head's fused sum Σ CE_i (a 0-dim tensor, which the
model passes where its logits would be, a `aniso_plugins.methods.fused_loss.loss_sum.FusedLossSum`
where the forward transforms it) and divide it by the same D, and leaves every call with real
logits (evaluation) to the model's own loss function. `label_alignment_in_forward` reads from the
same code how the model's loss aligns its labels (`aniso_plugins.models.alignment`). Duck-typed:
transformers is imported only to name ForCausalLMLoss.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

import torch
from torch import nn

from aniso_plugins.methods.fused_loss.head import TrainingHead
from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform
from aniso_plugins.methods.fused_loss.loss_sum import IDENTITY, fused_sum, transform_of

_HEAD_CALLS = ("float", "contiguous")
"""Methods a conventional forward may call on the head's output before naming it ``logits``."""


def why_loss_is_not_reproduced(model: nn.Module, ignore_index: int) -> str | None:
    """None if `model` (a transformers causal LM, not PEFT-wrapped) computes its training loss
    as ForCausalLMLoss of its head's unchanged output and the run ignores its label −100
    (`ignore_index`); otherwise what differs (a soft-cap or scale of the logits included: see
    `fused_loss_transform` for a caller that fuses it)."""
    why_not, transform = fused_loss_transform(model, ignore_index)
    if why_not is None and not transform.identity:
        return (f"{type(model).__name__}.forward transforms its logits after the head (scale {transform.scale}, "
                f"soft-cap {transform.softcap})")
    return why_not


def fused_loss_transform(model: nn.Module, ignore_index: int) -> tuple[str | None, LogitTransform]:
    """(None, transform) if `model` computes its training loss as ForCausalLMLoss of
    `transform` applied to its head's output (the identity, or the soft-cap / scale statements
    of Gemma 2/3, Cohere, Granite, Falcon-H1, with their values read from the model), and the
    run ignores the label −100; otherwise (what differs, the identity)."""
    if ignore_index != -100:
        return f"ignore_index={ignore_index}, but transformers' losses ignore -100", IDENTITY
    name = type(model).__name__
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "transformers is not installed", IDENTITY
    function = getattr(model, "loss_function", None)
    if function is not ForCausalLMLoss:
        return f"{name}'s loss function is {getattr(function, '__name__', function)!r}, not transformers' ForCausalLMLoss", IDENTITY
    head = model.get_output_embeddings()
    attribute = next((key for key, module in model._modules.items() if module is head), None)
    if attribute is None:
        return f"{name}'s LM head is not one of its own attributes", IDENTITY
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        return f"the code of {name}.forward cannot be read", IDENTITY
    problem, ops = _logits_flow(tree, attribute, model)
    if problem is not None:
        return f"{name}.forward {problem}", IDENTITY
    transform = transform_of(ops)
    if isinstance(transform, str):
        return f"{name}.forward {transform}", IDENTITY
    return None, transform


def loss_divides_by_item_count(model: nn.Module) -> bool:
    """Whether `model`'s forward (a transformers model, not PEFT-wrapped) computes its loss with
    ``self.loss_function(...)``, which divides by the ``num_items_in_batch`` the Trainer passes
    (the step's target count over all ranks), rather than a loss of its own (a micro-batch mean:
    ``CrossEntropyLoss()`` in Marian, T5, Bart, BERT). False when its code cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(n, ast.Call) and _is_self_attribute(n.func, "loss_function") for n in ast.walk(tree))


_LOSS_CALLS = ("CrossEntropyLoss", "cross_entropy", "loss_fct")
"""Names whose call in a forward computes a token cross-entropy of its own."""
_SHIFTING_LOSSES = ("ForCausalLMLoss",)
_ALIGNED_LOSSES = ("ForMaskedLMLoss",)


def label_alignment_in_forward(model: nn.Module) -> str | None:
    """How `model`'s forward (a transformers model, not PEFT-wrapped) aligns its labels with its
    logits in its own loss, read from its code: "causal" when it shifts them (``self.loss_function``
    is ForCausalLMLoss, or a ``labels[..., 1:]`` / ``logits[..., :-1, :]`` slice feeds its own
    cross-entropy), "aligned" when its cross-entropy takes them as they are (ForMaskedLMLoss, or
    ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))`` with no such slice: Bart's,
    Marian's, XLNet's causal-LM classes); None when the code does not say (unreadable, no loss
    of its own, another loss function)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    if any(_is_self_attribute(n.func, "loss_function") for n in calls):
        function = getattr(model, "loss_function", None)
        name = getattr(getattr(function, "original", function), "__name__", None)  # FusedCausalLMLoss: the model's own
        return "causal" if name in _SHIFTING_LOSSES else "aligned" if name in _ALIGNED_LOSSES else None
    if not any(_called_name(n) in _LOSS_CALLS for n in calls):
        return None
    return "causal" if any(_is_shift(n) for n in ast.walk(tree) if isinstance(n, ast.Subscript)) else "aligned"


_LABEL_SHIFTS = ("_shift_right", "prepare_decoder_input_ids_from_labels")
"""Methods of encoder-decoders that make the decoder's inputs from the labels (no loss)."""


def labels_passed_to(model: nn.Module, methods: bool = False) -> str | None:
    """The call (``self.pred_layer``) to which `model`'s forward hands its ``labels``, where it
    computes no loss of its own (XLM's head computes it), or None. `methods`: only a method of the
    model's own other than those that shift the labels into decoder inputs (ProphetNet's
    ``self._compute_loss``, which trains its n-gram streams on the same labels)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        arguments = [*call.args, *(k.value for k in call.keywords)]
        takes_labels = any(isinstance(a, ast.Name) and a.id == "labels" for a in arguments)
        own = isinstance(call.func, ast.Attribute) and _is_self_attribute(call.func, call.func.attr)
        if methods and own and (call.func.attr in _LABEL_SHIFTS or not callable(getattr(type(model), call.func.attr, None))
                                or call.func.attr in model._modules):
            continue
        if takes_labels and own and call.func.attr != "loss_function":  # loss_function: `label_alignment_in_forward`
            return f"self.{call.func.attr}"
    return None


def _called_name(call: ast.Call) -> str | None:
    """``f`` of ``f(...)``, ``x.f(...)`` and ``f(...)(...)``."""
    func = call.func.func if isinstance(call.func, ast.Call) else call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _is_shift(node: ast.Subscript) -> bool:
    """``labels[..., 1:]`` (or ``[:, 1:]``) or ``logits[..., :-1, :]`` (or ``[:, :-1]``): a slice
    that drops the first label or the last logit position."""
    owner = ast.unparse(node.value).lower()
    parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    slices = [p for p in parts if isinstance(p, ast.Slice) and p.step is None]

    def constant(value: ast.AST | None) -> object:
        return ast.literal_eval(value) if value is not None else None

    try:
        drops_first = "label" in owner and any(constant(p.lower) == 1 and p.upper is None for p in slices)
        drops_last = "logit" in owner and any(p.lower is None and constant(p.upper) == -1 for p in slices)
    except ValueError:  # a slice bound that is not a literal
        return False
    return drops_first or drops_last


def _logits_flow(tree: ast.AST, head: str, model: nn.Module) -> tuple[str | None, list[tuple]]:
    """What in a forward's tree departs from ``logits = self.<head>(h)`` (any name for
    ``logits``) followed only by elementwise transforms of it (``logits = logits / X``,
    ``* X``, ``torch.tanh(logits)``; ``self.<head>(h) * X``; a block of them under
    ``if <self attribute> is not None:``; X a number attribute of the model) and by
    ``self.loss_function(logits, ...)`` and the returned output: (None, the transforms' operations
    in order, with X's values), or (the departure, [])."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    heads = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_self_attribute(n.func, head)]
    if len(heads) != 1:
        return (f"calls self.{head} {len(heads)} times" if heads else f"does not call self.{head}"), []
    value = heads[0]
    while isinstance(parents[value], ast.Attribute) and parents[value].attr in _HEAD_CALLS:
        value = parents[parents[value]]  # self.lm_head(h).float(): the Call of the method
    ops: list[tuple] = []
    while (op := _scaling(parents[value], value, model)) is not None:  # self.lm_head(h) * X
        ops.append(op)
        value = parents[value]
    assign = parents[value]
    if not (isinstance(assign, ast.Assign) and len(assign.targets) == 1 and isinstance(assign.targets[0], ast.Name)):
        statement = _statement(value, parents)
        return f"computes on the head's output: `{ast.unparse(statement)}` (line {statement.lineno})", []
    name = assign.targets[0].id
    transforms = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and node is not assign and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            step = _transform_statement(node, name, parents, model)
            if isinstance(step, str):
                return step, []
            transforms[node] = step
    for node in sorted(transforms, key=lambda n: (n.lineno, n.col_offset)):
        ops.extend(transforms[node])
    inside = {n for statement in transforms for n in ast.walk(statement)}
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and n not in inside]
    to_loss = False
    for node in uses:
        parent = parents[node]
        call = parents[parent] if isinstance(parent, ast.keyword) else parent
        if isinstance(call, ast.Call) and _is_self_attribute(call.func, "loss_function"):
            to_loss = True
        elif node is not assign.targets[0] and not isinstance(parent, (ast.keyword, ast.Tuple)):
            statement = _statement(node, parents)
            return f"uses its logits after the head: `{ast.unparse(statement)}` (line {statement.lineno})", []
    return (None, ops) if to_loss else (f"does not pass {name} to self.loss_function", [])


def _number(node: ast.AST, model: nn.Module) -> float | None:
    """The value of a number literal or of a ``self.a.b`` attribute of `model` that holds a real
    number (or a 0-dim tensor), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    value = _attribute_value(node, model)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


_MISSING = object()


def _attribute_value(node: ast.AST, model: nn.Module) -> object:
    """The value of ``self.a.b...`` on `model`, or `_MISSING` for anything else."""
    path = []
    while isinstance(node, ast.Attribute):
        path.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "self" and path):
        return _MISSING
    value: object = model
    for attr in reversed(path):
        value = getattr(value, attr, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def _scaling(node: ast.AST, operand: ast.AST, model: nn.Module) -> tuple | None:
    """("mul", x) / ("div", x) when `node` is ``operand * X``, ``X * operand`` or ``operand / X``
    with X a number of the model (`_number`), else None."""
    if not isinstance(node, ast.BinOp) or not isinstance(node.op, (ast.Mult, ast.Div)):
        return None
    other = node.right if node.left is operand else node.left if isinstance(node.op, ast.Mult) and node.right is operand else None
    x = None if other is None else _number(other, model)
    return None if x is None else ("mul" if isinstance(node.op, ast.Mult) else "div", x)


def _transform_statement(node: ast.Assign, name: str, parents: dict, model: nn.Module) -> list[tuple] | str:
    """The operations of ``name = name * X`` / ``name / X`` / ``X * name`` / ``torch.tanh(name)``
    (none when it sits in an ``if self.<attr> is not None:`` block whose attribute is None), or
    why it is not such a statement."""
    block = parents[node]
    if isinstance(block, ast.If):
        test = block.test
        guarded = (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
                   and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)
        attribute = _attribute_value(test.left, model) if guarded else _MISSING
        if attribute is _MISSING or block.orelse:
            return f"transforms {name} under a condition it cannot read: `{ast.unparse(test)}` (line {block.lineno})"
        if attribute is None:
            return []  # the block does not run for this model
    elif isinstance(block, (ast.For, ast.While, ast.With, ast.Try)):
        return f"transforms {name} inside a {type(block).__name__.lower()} block (line {node.lineno})"
    value = node.value
    ops: list[tuple] | None = None
    if isinstance(value, ast.BinOp):
        operand = value.left if isinstance(value.left, ast.Name) and value.left.id == name else value.right
        op = _scaling(value, operand, model) if isinstance(operand, ast.Name) and operand.id == name else None
        ops = None if op is None else [op]
    elif isinstance(value, ast.Call) and ast.unparse(value.func) in ("torch.tanh", "tanh") and len(value.args) == 1:
        ops = [("tanh",)] if isinstance(value.args[0], ast.Name) and value.args[0].id == name else None
    if ops is None:
        return f"assigns {name} again after the head: `{ast.unparse(node)}` (line {node.lineno})"
    return ops


def _is_self_attribute(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name) and node.value.id == "self"


def _statement(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.AST:
    while not isinstance(node, ast.stmt):
        node = parents[node]
    return node


def causal_loss_denominator(
    labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor | int:
    """ForCausalLMLoss's D: `num_items_in_batch` if given, else the targets ≠ `ignore_index`
    (``shift_labels``, or `labels` without their first position)."""
    if num_items_in_batch is not None:
        return num_items_in_batch
    targets = shift_labels if shift_labels is not None else labels[..., 1:]
    return (targets != ignore_index).sum()


def _divided_by_denominator(
    summed: torch.Tensor,
    labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """`summed` (the head's fused sum) / `causal_loss_denominator`, on `summed`'s device."""
    denominator = causal_loss_denominator(labels, num_items_in_batch, ignore_index, shift_labels)
    if torch.is_tensor(denominator):
        denominator = denominator.to(summed.device)
    return summed / denominator


class FusedCausalLMLoss:
    """``model.loss_function`` while the head computes the fused loss: a 0-dim `logits` is the
    head's summed token loss (`fused_sum`), returned divided by `causal_loss_denominator`; real
    logits go to the model's own loss function `original`."""

    def __init__(self, original: Callable[..., torch.Tensor], ignore_index: int, transform: LogitTransform = IDENTITY) -> None:
        self.original = original
        self.ignore_index = ignore_index
        self.transform = transform

    def __call__(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
        if logits.dim() != 0:
            return self.original(
                logits, labels, vocab_size, num_items_in_batch, ignore_index=ignore_index, shift_labels=shift_labels, **kwargs
            )
        if ignore_index != self.ignore_index:
            raise ValueError(
                f"the model's loss ignores the label {ignore_index}, the fused loss {self.ignore_index}: set "
                f"AnisoConfig(ignore_index={ignore_index}) or fused_loss=False"
            )
        return _divided_by_denominator(fused_sum(logits, self.transform), labels, num_items_in_batch, ignore_index, shift_labels)


class FusedLabelSmoother:
    """A Trainer's ``label_smoother`` (transformers' ``LabelSmoother``, ε = ``epsilon``) while the
    head computes the fused loss with the same ε: a 0-dim logits is the head's
    Σ_i [(1 − ε) CE_i + ε mean_k(−log p_ik)], returned divided by LabelSmoother's denominator
    (`causal_loss_denominator` of the shifted labels); real logits go to `original`."""

    def __init__(self, original: Callable[..., torch.Tensor], transform: LogitTransform = IDENTITY) -> None:
        self.original = original
        self.epsilon = float(original.epsilon)
        self.ignore_index = original.ignore_index
        self.transform = transform

    def __call__(self, model_output, labels, shift_labels=False, num_items_in_batch=None):
        logits = model_output["logits"] if isinstance(model_output, dict) else model_output[0]
        if logits.dim() != 0:
            return self.original(model_output, labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
        if not shift_labels:
            raise ValueError("the fused loss reproduces label smoothing of causal LMs only (shift_labels=True)")
        return _divided_by_denominator(fused_sum(logits, self.transform), labels, num_items_in_batch, self.ignore_index)


def fused_token_outputs(logits: torch.Tensor, head: nn.Module,
                        transform: LogitTransform = IDENTITY) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(each position's log-probability, the token outputs by name) of a per-token call the LM
    `head` answered (TRL's fused LM head: `aniso_plugins.methods.fused_loss.head.TrainingHead.fuse`
    with ``token_outputs``): the first from what the model's forward passed where its logits would
    be, checked against the `transform` fused; the others from the head."""
    installed = TrainingHead.installed_on(head)
    return fused_sum(logits, transform), installed.take_token_outputs() if installed is not None else {}


def install_fused_causal_loss(model: nn.Module, ignore_index: int, transform: LogitTransform = IDENTITY) -> Callable[[], None]:
    """Set ``model.loss_function`` to `FusedCausalLMLoss` (its forward transforming the logits by
    `transform`); returns the function that undoes it."""
    had_own = "_loss_function" in model.__dict__
    own = model.__dict__.get("_loss_function")
    model.loss_function = FusedCausalLMLoss(model.loss_function, ignore_index, transform)

    def undo() -> None:
        if had_own:
            model.__dict__["_loss_function"] = own
        else:
            model.__dict__.pop("_loss_function", None)

    return undo


__all__ = [
    "FusedCausalLMLoss",
    "FusedLabelSmoother",
    "causal_loss_denominator",
    "fused_loss_transform",
    "fused_token_outputs",
    "install_fused_causal_loss",
    "label_alignment_in_forward",
    "labels_passed_to",
    "loss_divides_by_item_count",
    "why_loss_is_not_reproduced",
]
