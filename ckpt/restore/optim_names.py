"""Optimizer state by parameter name.

torch keys an optimizer's state by each parameter's position in its groups; an optimizer
built over the same parameters in another order (another wrapping order, parameters listed
otherwise) would take another parameter's moments. So every restore matches a saved
optimizer to its target by the parameters' names, from whichever side records them:

* the saving job's own record: each shard manifest lists, per optimizer of the state, its
  parameters' names (their FQNs in the modules of the same state, DDP's ``module.`` and
  torch.compile's ``_orig_mod.`` dropped, tied weights under their first name);
* a state keyed by name, as ``get_optimizer_state_dict`` (DCP, torchtitan) writes it, or
  torch's ``param_names`` in each group (an optimizer built from ``named_parameters()``).

The target's names come from the modules beside it in the state (or its own
``param_names``). Where either side cannot be named, nothing proves which moments belong to
which parameter: the restore is refused, naming ``match_by_position``, the explicit choice
to match by position (the parameters listed in the same order as when saved).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..errors import StateMismatch
from .plan import canonical_path

if TYPE_CHECKING:  # ``ckpt ls`` reads how optimizers are keyed without torch
    import torch

_BY_POSITION = "_ckpt_guard_by_position"


def match_by_position(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Mark ``optim`` so that a restore may match its saved state by position where the
    parameters cannot be named (its parameters listed in the order they had at save).
    Returns ``optim``, for use inside a state dict."""
    setattr(optim, _BY_POSITION, True)
    return optim


def param_names(state: Mapping[str, Any]) -> dict[str, list[str]]:
    """For each top-level optimizer whose parameters all belong to modules of ``state``:
    their names, in the optimizer's order (its groups concatenated)."""
    import torch

    names: dict[int, str] = {}
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            for fqn, p in value.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), canonical_path(fqn))
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            params = [p for g in value.param_groups for p in g["params"]]
            if all(id(p) in names for p in params):
                out[key] = [names[id(p)] for p in params]
            elif all("param_names" in g for g in value.param_groups):
                out[key] = [canonical_path(n) for g in value.param_groups for n in g["param_names"]]
    return out


def keyed_by_name(values: dict, recorded: Mapping[str, list[str]], is_tensor: Callable[[Any], bool]) -> dict:
    """``values`` (a checkpoint read whole) named as ``get_state_dict`` names a state, which is
    what DCP users load: each module's tensors without wrapper prefixes (DDP's ``module.``,
    torch.compile's ``_orig_mod.``), and each optimizer whose parameters' names were recorded
    keyed by those names, as ``get_optimizer_state_dict`` keys it. What an export hands DCP,
    so that ``dcp.load`` and ``ckpt import`` match by name. ``is_tensor``: a tensor leaf."""
    out = dict(values)
    for key, node in values.items():
        if isinstance(node, dict) and node and all(isinstance(k, str) and is_tensor(v) for k, v in node.items()):
            names = {k: canonical_path(k) for k in node}
            if len(set(names.values())) == len(names):
                out[key] = {names[k]: v for k, v in node.items()}
    for key, names in recorded.items():
        node = values.get(key)
        if not isinstance(node, dict) or not isinstance(node.get("param_groups"), list):
            continue
        ids = [p for g in node["param_groups"] for p in g.get("params", [])]
        if sorted(ids) != list(range(len(names))) or not isinstance(node.get("state"), dict):
            continue
        out[key] = {**node, "state": {names[i]: v for i, v in node["state"].items()},
                    "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in node["param_groups"]]}
    return out


def saved_layouts(tree: Any, recorded: Mapping[str, list[str]]) -> dict[str, str]:
    """How each top-level optimizer of a saved tree is keyed: "by name" or "by position"
    (``ckpt ls``: a positional one restores only by ``match_by_position``)."""
    out = {}
    for key, node in (tree.items() if isinstance(tree, dict) else ()):
        if _is_flat(node):
            out[key] = "by name"
        elif _is_optimizer_node(node):
            out[key] = "by name" if _saved_names(node, recorded.get(key)) is not None else "by position"
    return out


def match_optimizers(tree: Any, state: Mapping[str, Any], recorded: Mapping[str, list[str]]) -> None:
    """Rewrite each saved optimizer of ``tree`` (in place) into the numbering of ``state``'s
    optimizer of the same key, matched by parameter name; ``recorded``: the saving job's
    names (a shard manifest's ``param_names``). Raises StateMismatch where the names or
    their grouping differ, or where a side cannot be named (unless ``match_by_position``)."""
    import torch

    if not isinstance(tree, dict):
        return
    targets = param_names(state)
    for key, optim in state.items():
        node = tree.get(key)
        if isinstance(optim, torch.optim.Optimizer) and _is_flat(node):
            if key not in targets:
                raise StateMismatch(f"{key}: the checkpoint holds this optimizer flattened by parameter name "
                                    "(torchtitan's layout), but the target's parameters cannot be named; put the "
                                    "model beside the optimizer in the state")
            tree[key] = _from_flat(key, node, targets[key], optim)
            continue
        if not isinstance(optim, torch.optim.Optimizer) or not _is_optimizer_node(node):
            continue
        saved, target = _saved_names(node, recorded.get(key)), targets.get(key)
        positional = getattr(optim, _BY_POSITION, False)
        if saved is not None and target is not None:
            _renumber(key, node, saved, target, optim)
        elif positional:
            if saved is not None:  # keyed by name, matched in the saved order: positions
                _renumber(key, node, saved, saved, optim)
        elif saved is None and _state_items(key, node):
            raise StateMismatch(
                f"{key}: the checkpoint keys this optimizer's state by position (optimizer.state_dict()), so nothing "
                "says which parameter each moment belongs to; save it by name (get_optimizer_state_dict, or the "
                "model beside the optimizer in a ckpt-guard state), or, if the parameters are listed in the same "
                f"order as when it was saved, restore into ckpt.match_by_position(state[{key!r}])")
        elif saved is not None and target is None:
            raise StateMismatch(
                f"{key}: the checkpoint names this optimizer's parameters, but the target's cannot be named (they "
                "belong to no module of the state); put the model beside the optimizer in the state, build it "
                "from named_parameters(), or, if the parameters are listed in the same order as when it was "
                f"saved, restore into ckpt.match_by_position(state[{key!r}])")


def _is_flat(node: Any) -> bool:
    """An optimizer flattened by ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``
    (torchtitan): "state.<fqn>.<name>" and "param_groups.<fqn>.<name>" keys."""
    return (isinstance(node, dict) and bool(node) and any(k.startswith("param_groups.") for k in node)
            and all(k.startswith(("state.", "param_groups.")) for k in node))


def _from_flat(key: str, node: dict, names: list[str], optim: torch.optim.Optimizer) -> dict:
    """A flattened optimizer (saved tree) in torch's layout, numbered as ``optim``."""
    left, state, groups, start = dict(node), [], [], 0

    def take(prefix: str) -> dict:
        got = {k[len(prefix):]: left.pop(k) for k in [k for k in left if k.startswith(prefix)]}
        return got

    for group in optim.param_groups:
        hyper = [take(f"param_groups.{name}.") for name in names[start:start + len(group["params"])]]
        if not hyper[0] or any(h != hyper[0] for h in hyper):
            raise StateMismatch(f"{key}: the checkpoint's optimizer groups its parameters otherwise than the "
                                f"target (group {len(groups)}: {', '.join(names[start:start + 3])} ...); build the "
                                "optimizer's groups as they were saved")
        groups.append({**hyper[0], "params": list(range(start, start + len(hyper)))})
        state += [[start + i, moments] for i, name in enumerate(names[start:start + len(hyper)])
                  if (moments := take(f"state.{name}."))]
        start += len(hyper)
    if left:
        raise StateMismatch(f"{key}: the checkpoint's optimizer has other parameters than the target's "
                            f"({', '.join(sorted(left)[:5])})")
    return {"state": {"__dict__": state} if state else {}, "param_groups": groups}


def _is_optimizer_node(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("param_groups"), list) and "state" in node


def _flat_params(node: dict) -> list[Any]:
    out = []
    for g in node["param_groups"]:
        params = g.get("params") if isinstance(g, dict) else None
        if not isinstance(params, list):
            raise StateMismatch("the checkpoint's optimizer state is not laid out as torch's (a group without params)")
        out += params
    return out


def _saved_names(node: dict, recorded: list[str] | None) -> list[str] | None:
    """The saved parameters' names, in the saved order; None when the checkpoint has none."""
    try:
        params = _flat_params(node)
    except StateMismatch:
        return None
    if params and all(isinstance(p, str) for p in params):
        return [canonical_path(p) for p in params]  # keyed by name (get_optimizer_state_dict)
    groups = node["param_groups"]
    if all(isinstance(g.get("param_names"), list) for g in groups):
        names = [n for g in groups for n in g["param_names"]]
        if len(names) == len(params) and all(isinstance(n, str) for n in names):
            return [canonical_path(n) for n in names]
    if recorded is not None and len(recorded) == len(params):
        return list(recorded)
    return None


def _state_items(key: str, node: dict) -> list[list[Any]]:
    """The saved ``state`` as [id, value] pairs (ids as saved: positions or names)."""
    state = node["state"]
    if not isinstance(state, dict):
        raise StateMismatch(f"{key}: the checkpoint's optimizer state is not laid out as torch's")
    if set(state) == {"__dict__"} and isinstance(state["__dict__"], list):
        return [list(kv) for kv in state["__dict__"]]
    return [[k, v] for k, v in state.items()]


def _renumber(key: str, node: dict, saved: list[str], target: list[str], optim: torch.optim.Optimizer) -> None:
    if sorted(saved) != sorted(target) or len(set(target)) != len(target):
        raise StateMismatch(f"{key}: the checkpoint's optimizer has other parameters than the target's "
                            f"({', '.join(sorted(set(saved) ^ set(target))[:5]) or 'a name listed twice'})")
    index = {name: i for i, name in enumerate(target)}
    ids = _flat_params(node)
    perm = {_id_key(p): index[name] for p, name in zip(ids, saved)}
    groups, start = [], 0
    for g in optim.param_groups:
        groups.append(list(range(start, start + len(g["params"]))))
        start += len(g["params"])
    saved_groups = {frozenset(perm[_id_key(p)] for p in g["params"]): g for g in node["param_groups"]}
    if set(saved_groups) != {frozenset(g) for g in groups}:
        raise StateMismatch(f"{key}.param_groups: checkpoint has {len(node['param_groups'])} parameter groups, "
                            f"target {len(groups)}, and they do not hold the same parameters (matched by name, in "
                            "any order); build the optimizer's groups as they were saved")
    node["param_groups"] = [saved_groups[frozenset(g)] for g in groups]  # groups, too, matched by their members
    for g, want, target_group in zip(node["param_groups"], groups, optim.param_groups):
        g["params"] = want
        if "param_names" in target_group:
            g["param_names"] = list(target_group["param_names"])
        else:
            g.pop("param_names", None)
    items = _state_items(key, node)
    unknown = [k for k, _ in items if _id_key(k) not in perm]
    if unknown:
        raise StateMismatch(f"{key}: the checkpoint's optimizer state names parameters its groups do not list "
                            f"({unknown[:5]})")
    node["state"] = {"__dict__": [[perm[_id_key(k)], v] for k, v in items]} if items else {}


def _id_key(p: Any) -> Any:
    """A saved parameter id as the state and the groups both spell it (DCP names keys as strings)."""
    return canonical_path(p) if isinstance(p, str) and not p.isdigit() else int(p) if isinstance(p, str) else p
