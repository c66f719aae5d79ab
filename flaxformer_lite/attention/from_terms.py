"""A variant written once: its block terms (chunked.BlockTerms) give both kernels.

A variant registered with `terms` (registry.AttentionVariant) is a function
  terms(num_heads, **options) -> chunked.BlockTerms
and nothing else: what it changes in a block of scaled q.k scores (`score`),
the tables its blocks read (`prepare`), its maps of the queries and keys
(`transform_q`, `transform_k`) and its values term; the kernels compute q.k
and the scaling themselves. The dense path evaluates the terms on the
whole [n, m] as one block (kernels/reference.py `dense_attention`: queries at q_offset + 0..n-1,
keys at 0..m-1, the masked softmax and dropout of softmax.py), the chunked
path block by block (`dot_product_chunked`: chunked.attend). Decoding,
packing and grouped-query attention come with the two kernels. A
hand-written dense form (Shaw's reshape-and-matmul trick, the paper's
reference) may still be registered as `fn`; the registry-wide tests hold it
to the derived one.

`check_terms` runs at a variant's first lookup (registry.get; not at import,
which must run no JAX computation): `values` must be linear in the weights
(the chunked backward's delta_i = dO_i . O_i relies on it). A `values` term
also brings its `uniform` (chunked.BlockTerms refuses it otherwise).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention import chunked
# The dense path of a scheme given as terms is the reference kernel's.
from flaxformer_lite.attention.kernels.reference import dense_attention, prepared  # noqa: F401


def dot_product_chunked(query, key, value, terms=chunked.BlockTerms(), params=None, *,
                        mask=None, q_offset=0, chunk_size=None, dtype=None, dropout_rate=0.0,
                        dropout_rng=None):
  """dot_product_attention block by block (chunked.attend): mask a
  masks.MaskSpec or masks.Mask; O(n) memory, the same attention dropout. The
  queries are scaled by 1/sqrt(d) here, once; `terms` and `params` are a
  scheme's block terms and their parameters."""
  dtype = dtype or query.dtype
  scaled = query.astype(dtype) / jnp.sqrt(query.shape[-1]).astype(dtype)
  return chunked.attend(scaled, key, value, terms, params, mask=mask, q_offset=q_offset,
                        chunk_size=chunk_size, dtype=dtype, dropout_rate=dropout_rate,
                        dropout_rng=dropout_rng)


def variant_fns(make_terms: Callable[..., chunked.BlockTerms], option_names) -> tuple:
  """(fn, chunked) for the registry from `make_terms(num_heads, **options)`.
  Keyword arguments named in `option_names` are the variant's options, the
  others (besides the kernels' own) its parameters."""
  option_names = frozenset(option_names)

  def split(query, rest):
    options = {k: v for k, v in rest.items() if k in option_names}
    params = {k: v for k, v in rest.items() if k not in option_names}
    return make_terms(query.shape[2], **options), params

  def fn(query, key, value, *, mask=None, bias=None, q_offset=0, positions=None,
         dropout_rate=0.0, dropout_rng=None, deterministic=True, dtype=None,
         return_weights=False, **rest):
    terms, params = split(query, rest)
    # A block_score may read a block's positions as a range: with positions
    # as data the elementwise score runs.
    return dense_attention(query, key, value, terms, params, mask=mask, bias=bias,
                           q_offset=q_offset, positions=positions, dropout_rate=dropout_rate,
                           dropout_rng=dropout_rng, deterministic=deterministic, dtype=dtype,
                           return_weights=return_weights, elementwise=positions is not None)

  def chunked_fn(query, key, value, *, mask=None, q_offset=0, chunk_size=None, dtype=None,
                 dropout_rate=0.0, dropout_rng=None, **rest):
    terms, params = split(query, rest)
    return dot_product_chunked(query, key, value, terms, params, mask=mask, q_offset=q_offset,
                               chunk_size=chunk_size, dtype=dtype, dropout_rate=dropout_rate,
                               dropout_rng=dropout_rng)

  return fn, chunked_fn


def _run_now(fn: Callable, *args):
  """fn(*args) in one compilation, every input traced (op by op, each small
  op would compile alone), compiled ahead of time: it runs now and returns
  arrays even when called while a model is traced (a jitted call would be
  staged into that trace)."""
  return jax.jit(fn).lower(*args).compile()(*args)


def check_terms(name: str, terms: chunked.BlockTerms, params: Mapping[str, Any],
                num_heads: int, head_dim: int, seed: int = 0) -> None:
  """Raises TypeError unless a values term of the scheme's own is linear in
  the weights (_check_linear; dot_values is, as written) and, with
  additive=True, its score adds a bias (_check_additive)."""
  r = np.random.default_rng(seed)
  if terms.values is not chunked.dot_values:
    _check_linear(name, terms, params, num_heads, head_dim, r)
  if terms.additive:
    _check_additive(name, terms, params, num_heads, r)


def _check_linear(name, terms, params, num_heads, head_dim, r):
  """values(a p1 + c p2) = a values(p1) + c values(p2) on random inputs (a
  block of 3 queries at positions 5..7 against 4 keys at 0..3, the tables
  terms.prepare makes of `params`), computed at float32 matmul precision
  whatever the backend's default."""
  p1, p2 = (np.float32(r.uniform(size=(1, num_heads, 3, 4))) for _ in range(2))
  v = np.float32(r.normal(size=(1, 4, num_heads, head_dim)))
  q_pos, k_pos = np.arange(5, 8), np.arange(4)
  a, c = 0.7, -1.9

  def three(p1, p2, v, params, q_pos, k_pos):
    tables = prepared(terms, params, q_pos, k_pos)
    values = lambda p: terms.values(p, v, tables, q_pos, k_pos)
    return values(a * p1 + c * p2), values(p1), values(p2)

  # At float32 matmul precision: a GPU's default (TF32) or a TPU's (bf16
  # passes) rounds a linear term by more than the tolerance.
  with jax.default_matmul_precision('highest'):
    out = _run_now(three, p1, p2, v, params, q_pos, k_pos)
  got, v1, v2 = (np.asarray(x, np.float64) for x in out)
  want = a * v1 + c * v2
  scale = max(1.0, float(np.max(np.abs(want))))
  if not np.allclose(got, want, rtol=1e-4, atol=1e-4 * scale):
    raise TypeError(
        f'attention variant {name!r}: BlockTerms.values is not linear in the weights p '
        f'(values(0.7 p1 - 1.9 p2) differs from 0.7 values(p1) - 1.9 values(p2) by up to '
        f'{float(np.max(np.abs(got - want))):.3g}); the chunked backward needs '
        'sum_j p_ij dvalues/dp_ij = dO . O, which holds only for a linear term')


def _check_additive(name, terms, params, num_heads, r):
  """Raises TypeError unless score(s) = s + score(0) on random scores (a
  BlockTerms with additive=True: the kernels add score(0) as a bias)."""
  s = np.float32(r.normal(size=(1, num_heads, 3, 4)) * 3)
  q_pos, k_pos = np.arange(5, 8), np.arange(4)
  heads = np.arange(num_heads)[:, None, None]

  def both(s, params):
    tables = prepared(terms, params, q_pos, k_pos)
    score = lambda x: terms.score(x, q_pos[:, None], k_pos[None, :], heads, tables)
    return score(s), s + score(jnp.zeros_like(s))

  got, want = (np.asarray(x, np.float64) for x in _run_now(both, s, params))
  if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
    raise TypeError(f'attention variant {name!r}: BlockTerms(additive=True) but its score is '
                    f'not s + score(0) (off by up to {float(np.max(np.abs(got - want))):.3g}); '
                    'drop additive=True')


def random_params(specs: Mapping[str, Any], seed: int = 0) -> dict:
  """{name: (shape, init, axes)} (AttentionVariant.params) -> arrays from
  each initializer."""
  def draw(seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(specs))
    return {name: init(k, shape, jnp.float32)
            for k, (name, (shape, init, _)) in zip(keys, sorted(specs.items()))}

  if not specs:
    return {}
  return _run_now(draw, np.int32(seed))
