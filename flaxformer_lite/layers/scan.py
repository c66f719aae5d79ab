"""Unrolled <-> scanned layouts of a Transformer stack's variables.

A stack of L blocks is unrolled, `layer_0` .. `layer_{L-1}` side by side, or
scanned (`model.scan_layers`, layers/transformer.py): one `layers` subtree
with the same names below it, each leaf the L layers' leaves stacked on a new
axis 0. `stack_layers` and `unstack_layers` turn any tree of either layout
into the other: parameters, their gradients, optimizer moments, the decoding
cache (`cache_index` [] per layer <-> [L]) and sown intermediates. Every
mapping holding `layer_<i>` keys is a stack (the fusion model's `a_layer_0`
and the RNN's `layer_0_forward` are not); indices must run 0..L-1.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

SCANNED = 'layers'  # the scanned block's name, and the logical axis of its leading dimension
_UNROLLED = re.compile(r'layer_(\d+)')


def stack_layers(tree: Any) -> Any:
  """Unrolled -> scanned: in every mapping, `layer_0` .. `layer_{L-1}`
  (same structure each) become `layers`, leaves [L, ...]. Other keys, and
  trees without stacks, pass through."""
  return _map_mappings(tree, _stack)


def unstack_layers(tree: Any) -> Any:
  """Scanned -> unrolled: every `layers` subtree (leaves [L, ...]) becomes
  `layer_0` .. `layer_{L-1}`. The inverse of stack_layers, exactly."""
  return _map_mappings(tree, _unstack)


def is_stacked(tree: Any) -> bool:
  """Whether any mapping in tree holds a scanned `layers` subtree."""
  if isinstance(tree, Mapping):
    return SCANNED in tree or any(is_stacked(v) for v in tree.values())
  return isinstance(tree, (tuple, list)) and any(is_stacked(v) for v in tree)


def _stack(node: dict) -> dict:
  indices = sorted(int(m.group(1)) for k in node if (m := _UNROLLED.fullmatch(k)))
  if not indices:
    return node
  if indices != list(range(len(indices))) or SCANNED in node:
    raise ValueError(f'cannot stack layers {indices} (keys {sorted(node)}): a stack runs '
                     f'layer_0 .. layer_{{L-1}}, beside no {SCANNED!r}')
  layers = [node[f'layer_{i}'] for i in indices]
  out = {k: v for k, v in node.items() if not _UNROLLED.fullmatch(k)}
  out[SCANNED] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return out


def _unstack(node: dict) -> dict:
  if SCANNED not in node:
    return node
  stacked = node[SCANNED]
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree.leaves(stacked)}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f'{SCANNED!r} leaves must share one leading (layer) axis; got sizes '
                     f'{sorted(sizes, key=str)}')
  out = {k: v for k, v in node.items() if k != SCANNED}
  for i in range(sizes.pop()):
    out[f'layer_{i}'] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return out


def _map_mappings(tree: Any, fn: Callable[[dict], dict]) -> Any:
  """fn applied to every mapping of tree, children first; tuples, lists and
  named tuples (optimizer states) are walked, other leaves kept."""
  if isinstance(tree, Mapping):
    return fn({k: _map_mappings(v, fn) for k, v in tree.items()})
  if isinstance(tree, tuple) and hasattr(tree, '_fields'):
    return type(tree)(*(_map_mappings(v, fn) for v in tree))
  if isinstance(tree, (tuple, list)):
    return type(tree)(_map_mappings(v, fn) for v in tree)
  return tree
