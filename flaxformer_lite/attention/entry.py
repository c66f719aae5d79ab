"""The one entry point: attention of projected queries, keys and values
under a named scheme or an inline score, and a mask, on the kernel `auto`
picks.

  out = attend(q, k, v, scheme='alibi', mask=masks.causal())
  out = attend(q, k, v, score=lambda s, b, h, q, k, t: 30 * jnp.tanh(s / 30))

Everything a variant needs besides q, k and v (its options and parameters,
positions, a decoding offset, dropout, the RNN decoders' alignment) is an
argument here; which of them a variant reads, and which kernel runs it, is
decided here from its registry entry and select.py's policy, so that the
layers hold projections and caches only.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

from flaxformer_lite.attention import masks, registry, select
from flaxformer_lite.attention.kernels import pallas_gpu, product
from flaxformer_lite.attention.scheme import Terms, call_tables, query_key_positions


def attend(query, key, value, *, scheme: str = 'dot_product', score=None, tables=None,
           mask=None, kernel: str | None = None, scale: float | None = None,
           options: Mapping[str, Any] | None = None, params: Mapping[str, Any] | None = None,
           q_offset=0, positions=None, bias=None, dropout_rate: float = 0.0, dropout_rng=None,
           rng=None, prev_alignment=None, decoding: bool = False, dtype=None,
           return_weights: bool = False):
  """Attention under `scheme` (a registry name) or an inline `score`.

  Args:
    query: [b, n, h, d], query i at position q_offset + i (or positions[i]);
      key, value: [b, m, g, d], g dividing h (grouped-query attention).
    scheme: the variant's registry name (`--list_attention`).
    score, tables: in place of `scheme`, a score(s, b, h, q_pos, k_pos,
      tables) -> s run unregistered (scheme.py), with its tables by name.
    mask: None, a masks.Mask, a masks.MaskSpec or a boolean array
      broadcastable to [b, h, n, m] (True = may attend).
    kernel: 'auto' (select.py), 'dense', 'chunked' or one of the variant's
      own (dot_product: 'xla', 'cudnn'); None: options' `implementation`.
    scale: what q.k is multiplied by before the score (default 1/sqrt(d)).
    options: the variant's options and the kernel options
      (config.model.attention_kwargs; unset ones may be None).
    params: the variant's parameters by name (AttentionVariant.params).
    q_offset: the first query's position (int, may be traced: decoding).
    positions: int [n] (self-attention, n = m): the positions of the queries
      and keys in place of q_offset + i and j (randomized positions).
    bias: broadcastable to [b, h, n, m], added to the scaled scores (the
      dense kernel only).
    dropout_rate, dropout_rng: attention dropout, on when dropout_rng is set.
    rng: a PRNG key for a stochastic variant (hard attention), or None.
    prev_alignment: [b, h, n, m], the RNN decoder's summed earlier weights
      (location-sensitive attention); zeros when None.
    decoding: the call is one step of cached decoding (select.py weighs it).
    dtype: the computation's dtype (default: query's).
    return_weights: also return the weights [b, h, n, m] (dense kernel).
  Returns:
    [b, n, h, dv]; with return_weights, (that, weights).
  """
  variant, params = _variant(scheme, score, tables, params)
  scheme = variant.name
  given = dict(options or {})
  if kernel is not None:
    given['implementation'] = kernel
  kwargs = registry.resolve_kwargs(variant, given)
  kernel_options = registry.resolve_kernel(variant, given)
  dtype = dtype or query.dtype
  h = query.shape[2]
  _check_params(variant, params, h, query.shape[3], kwargs)
  query = _scaled(variant, query, scale)
  reads_positions = positions is not None and variant.uses_positions
  if reads_positions and not variant.position_arrays:
    raise ValueError(f'attention={scheme!r} reads positions as q_offset + 0..n-1 only; '
                     f'randomized positions need one of {registry.position_array_names()}')
  dropout = dropout_rng is not None and dropout_rate > 0.0
  kind = select.mask_kind(mask, q_offset) if bias is None else None
  terms = variant.terms(h, **kwargs) if variant.terms is not None else None
  chosen = select.choose_kernel(variant, kernel_options, query, key,
                                return_weights=return_weights, dtype=dtype, decoding=decoding,
                                positions=reads_positions, dropout=dropout, mask_kind=kind,
                                terms=terms, mask=mask)
  if chosen == 'pallas':
    if bias is not None or dropout:
      raise ValueError("the fused Pallas kernel takes no explicit bias and no attention "
                       "dropout; use attention_kwargs.implementation='dense' or 'chunked'")
    return fused_scheme(query, key, value, terms, params, mask=mask, q_offset=q_offset,
                        positions=positions if reads_positions else None, dtype=dtype)
  if chosen == 'chunked':
    if bias is not None:
      raise ValueError("the chunked attention kernel takes no explicit bias; use "
                       "attention_kwargs.implementation='dense'")
    spec = mask if isinstance(mask, (masks.MaskSpec, masks.Mask)) else masks.MaskSpec(dense=mask)
    return variant.chunked(query, key, value, mask=spec, q_offset=q_offset,
                           chunk_size=select.chunk_size(kernel_options.chunk_size), dtype=dtype,
                           dropout_rate=dropout_rate if dropout else 0.0,
                           dropout_rng=dropout_rng if dropout else None, **params, **kwargs)
  return _dense(variant, kernel_options, query, key, value, mask=mask, kind=kind, bias=bias,
                q_offset=q_offset, positions=positions, rng=rng, prev_alignment=prev_alignment,
                dropout_rate=dropout_rate if dropout else 0.0,
                dropout_rng=dropout_rng if dropout else None, dtype=dtype,
                return_weights=return_weights, **params, **kwargs)


def _variant(scheme: str, score, tables, params):
  """(the registry entry, its parameters) for attend's `scheme`, or an
  unregistered one for an inline `score` with its `tables`."""
  if score is None:
    if tables is not None:
      raise ValueError(f'attend(tables=...) goes with an inline score=; attention={scheme!r} '
                       'takes its parameters as params=')
    return registry.get(scheme), dict(params or {})
  if scheme != 'dot_product':
    raise ValueError(f'attend(scheme={scheme!r}, score=...): give a registered scheme or an '
                     'inline score, not both')
  if params is not None:
    raise ValueError('attend(score=...) reads its arrays from tables=, not params=')
  return registry.inline(score), dict(tables or {})


def _scaled(variant, query, scale):
  """query [b, n, h, d] so that the kernels' 1/sqrt(d) scales q.k by `scale`
  (None: query itself)."""
  if scale is None:
    return query
  if variant.terms is None:
    raise ValueError(f'attend(scale={scale!r}): attention={variant.name!r} does not score by '
                     'q.k; scale= applies to the dot-product schemes')
  ratio = scale * query.shape[3] ** 0.5
  return (query.astype(jnp.promote_types(query.dtype, jnp.float32)) * ratio).astype(query.dtype)


def _check_params(variant, params, heads: int, head_dim: int, kwargs) -> None:
  """Raises ValueError naming the parameters `variant` declares that
  `params` lacks."""
  if variant.params is None:
    return
  missing = sorted(set(variant.params(heads, head_dim, kwargs)) - set(params))
  if missing:
    raise ValueError(f'attention={variant.name!r} reads the parameters {missing} '
                     f'(AttentionVariant.params), and params= holds {sorted(params) or "none"}')


def _dense(variant, kernel_options, query, key, value, *, mask, kind, q_offset, positions, rng,
           prev_alignment, **common):
  """The variant's dense function `fn`, given what its registry entry says
  it reads (positions, its own kernels, a PRNG key, the earlier alignment)."""
  (b, n, h, _), (m, g) = query.shape, key.shape[1:3]
  if g != h and not variant.grouped_kv:
    # contiguous groups: heads [0, h/g) read key/value head 0, and so on
    key, value = (jnp.repeat(x, h // g, axis=2) for x in (key, value))  # [b, m, h, d]
  if variant.fused_fits is None or kind is None:  # else fn takes the MaskSpec
    mask = masks.as_dense(mask, b, h, n, m, q_offset)
  extra = {}
  if variant.uses_positions:
    extra['q_offset'] = q_offset
    if positions is not None:
      extra['positions'] = positions
  if variant.dense_implementations:
    extra['implementation'] = kernel_options.implementation
  if variant.stochastic:
    extra['rng'] = rng
  if variant.uses_alignment:
    extra['prev_alignment'] = (jnp.zeros((b, h, n, m), jnp.float32) if prev_alignment is None
                               else prev_alignment)
  return variant.fn(query, key, value, mask=mask,
                    deterministic=common['dropout_rng'] is None, **common, **extra)


def fused_scheme(query, key, value, terms: Terms, params, *, mask=None, q_offset=0,
                 positions=None, dtype=None):
  """A scheme's terms on the fused Pallas kernel (kernels/pallas_gpu.py;
  interpreted off a GPU): its tables made once, its q and k maps applied
  before the kernel, its elementwise score inside it.

  query [b, n, h, d], key and value [b, m, g, d]; mask as `attend`'s; a row
  that sees no key gets the uniform weights of the other kernels (the mean
  value). Returns [b, n, h, dv] in `dtype`.
  """
  dtype = dtype or query.dtype
  b, n, h, _ = query.shape
  m = key.shape[1]
  q_pos, k_pos = query_key_positions(n, m, q_offset, positions)
  tables = call_tables(terms, params, q_pos, k_pos) or {}
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  origin = k_pos[0]  # as the dense reference measures, one block for the call
  if terms.transform_q is not None:
    query = terms.transform_q(query, tables, q_pos, origin)
  if terms.transform_k is not None:
    key = terms.transform_k(key, tables, k_pos, origin)
  spec = mask if isinstance(mask, masks.MaskSpec) else None
  causal = spec is not None and spec.causal and spec.window is None and not spec.has_arrays()
  if causal or mask is None:
    rule = None
  elif isinstance(mask, masks.Mask):
    if masks.closes_over_arrays(mask):
      raise ValueError(f'mask {mask.name!r} reads an array its function closed over; the fused '
                       'Pallas kernel takes a mask\'s data as inputs: give them as '
                       'masks.Mask(fn, name, arrays=(...)), fn(b, h, q, k, *arrays)')
    rule = mask
  else:
    rule = (spec or masks.MaskSpec(dense=mask)).to_mask()
  out = pallas_gpu.flash_attention(
      query, key, value, score=terms.score, tables=tables, mask=rule, causal=causal,
      q_positions=q_pos, k_positions=k_pos, q_offset=q_offset,
      interpret=select.platform() != 'gpu')
  if rule is None:
    return out
  seen = masks.rows_seeing_a_key(rule, b, h, n, m, q_offset)  # [b | 1, h | 1, n]
  mean = product.repeat_heads(terms.uniform(value, tables, q_pos, m), h)  # [b, n, h, dv]
  return jnp.where(jnp.moveaxis(seen, 1, 2)[..., None], out, mean.astype(out.dtype))
