"""DeBERTa disentangled attention (He et al. 2021, section 3.1, eq. 4;
DeBERTa-v2's log-bucketed relative positions).

For query i at absolute position p_i = q_offset + i and key j, per head:

  A_ij = (q_i . k_j + q_i . K^r_{idx(p_i - j)} + k_j . Q^r_{idx(+-(p_i - j))}) / sqrt(3d)

content-to-content, content-to-position and position-to-content. The
position-to-content row: the paper's eq. 4 reads the row of j - p_i
(`p2c_row='paper'`); the released DeBERTa code and Hugging Face's read the
row of p_i - j, as content-to-position does (microsoft/DeBERTa issue 162),
and published weights and numbers carry that convention (`'released'`, the
default). K^r = P W_k,r
and Q^r = P W_q,r project one relative-position embedding table P
[2s, h*d] onto each head; s = `position_buckets`. idx(r) = clamp(bucket(r) + s,
0, 2s - 1) with `log_bucket`: offsets shorter than s/2 keep their own row,
longer ones share log-spaced rows up to `max_relative_positions`.

P and the projections are per layer here (the paper shares P across layers
and layer-normalises it; v2 reuses the content projections for W_k,r, W_q,r).
Both position terms are computed once per distance that occurs (a matmul
with one K^r or Q^r row per distance, [b, h, n, n + m - 1]) and moved to
their keys by `scheme.rel_shift`, as Transformer-XL's; the block terms do
the same per block (`_score`), from rows looked up once per call (`_prepare`).
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.attention import registry, scheme
from flaxformer_lite.attention.kernels import product
from flaxformer_lite.attention.kernels.reference import dot_product_attention


def log_bucket(relative_position, *, position_buckets: int, max_relative_positions: int):
  """DeBERTa-v2's bucket of an offset r: r itself where |r| <= s/2, else
  sign(r) (s/2 + ceil(log(|r| / (s/2)) / log((max - 1) / (s/2)) * (s/2 - 1))).

  relative_position: int array, any shape -> int32, same shape.
  """
  r = jnp.asarray(relative_position, jnp.int32)
  mid = position_buckets // 2
  far = jnp.maximum(jnp.abs(r), mid).astype(jnp.float32)  # >= mid: log() finite
  # The denominator's log in float32 as the numerator's, so that |r| = max - 1
  # gives a ratio of exactly 1 (bucket s - 1), never 1 + an ulp.
  top = jnp.full((), max_relative_positions - 1, jnp.float32)
  log_pos = jnp.ceil(jnp.log(far / mid) / jnp.log(top / mid) * (mid - 1)) + mid
  return jnp.where(jnp.abs(r) <= mid, r, jnp.sign(r) * log_pos.astype(jnp.int32))


def row_index(relative_position, position_buckets: int, max_relative_positions: int):
  """The row of P for an offset: clamp(log_bucket(r) + s, 0, 2s - 1)."""
  s = position_buckets
  bucket = log_bucket(relative_position, position_buckets=s,
                      max_relative_positions=max_relative_positions)
  return jnp.clip(bucket + s, 0, 2 * s - 1)


def position_projections(rel_embeddings, position_key_kernel, position_query_kernel):
  """P [2s, h*d], W_k,r and W_q,r [h*d, h, d] -> K^r, Q^r float32 [2s, h, d]."""
  p = rel_embeddings.astype(jnp.float32)
  return (jnp.einsum('rf,fhd->rhd', p, position_key_kernel.astype(jnp.float32)),
          jnp.einsum('rf,fhd->rhd', p, position_query_kernel.astype(jnp.float32)))


P2C_ROWS = {'released': 1, 'paper': -1}  # the sign of p - j in the p2c row


def _distance_rows(kr, qr, distances, buckets, one_hot: bool, p2c_row: str = 'released'):
  """Per distance t = p - j: K^r_idx(t) and Q^r_idx(t) ('released') or
  Q^r_idx(-t) ('paper'), float32 [L, h, d] each. A one-hot matmul (gradient:
  a matmul, deterministic) or a gather (cheaper; gradient: a scatter-add)."""
  rows = []
  for table, sign in ((kr, 1), (qr, P2C_ROWS[p2c_row])):
    index = row_index(sign * distances, *buckets)
    if one_hot:
      rows.append(jnp.einsum('lr,rhd->lhd', jax.nn.one_hot(index, table.shape[0]), table))
    else:
      rows.append(jnp.take(table, index, axis=0))
  return rows


def _position_logits(q, k, k_rows, q_rows):
  """q_i . K^r_idx(p_i - j) + k_j . Q^r_(its row of p_i - j): q [b, n, h, d],
  k [b, m, h, d]; k_rows, q_rows [n + m - 1, h, d] for the block's distances
  p_i - j from the largest (p_{n-1} - j_0) down -> float32 [b, h, n, m].

  Each term is a matmul with one row per distance, moved to its keys by
  scheme.rel_shift (the position-to-content one by key rows, then transposed)."""
  c2p = jnp.einsum('bnhd,lhd->bhnl', q, k_rows.astype(q.dtype), preferred_element_type=jnp.float32)
  p2c = jnp.einsum('bmhd,lhd->bhml', k, q_rows[::-1].astype(k.dtype),
                   preferred_element_type=jnp.float32)  # distances ascending
  return scheme.rel_shift(c2p) + jnp.swapaxes(scheme.rel_shift(p2c), -1, -2)


def deberta_attention(query, key, value, rel_embeddings, position_key_kernel,
                      position_query_kernel, *, mask=None, bias=None, q_offset=0,
                      positions=None, position_buckets=256, max_relative_positions=512,
                      p2c_row='released',
                      dropout_rate=0.0, dropout_rng=None, deterministic=True, dtype=None,
                      return_weights=False):
  """DeBERTa disentangled attention (module docstring).

  Args:
    query: [b, n, h, d], query i at absolute position q_offset + i.
    key, value: [b, m, h, d], key j at position j.
    positions: None, or int [n] (n = m): query and key i at positions[i];
      the rows are then gathered per pair ([n, m, h, d], for training lengths).
    rel_embeddings: P [2 * position_buckets, h*d];
    p2c_row: 'released' | 'paper' (module docstring);
    position_key_kernel, position_query_kernel: W_k,r, W_q,r [h*d, h, d].
    mask: boolean, broadcastable to [b, h, n, m]; True = may attend.
    bias: broadcastable to [b, h, n, m]; added to the scaled logits.
  Returns:
    [b, n, h, d] in `dtype` (default: query's dtype).
  """
  n, d = query.shape[1], query.shape[-1]
  m = key.shape[1]
  cdt = dtype or query.dtype
  kr, qr = position_projections(rel_embeddings, position_key_kernel, position_query_kernel)
  buckets = (position_buckets, max_relative_positions)
  if positions is None:
    distances = q_offset + n - 1 - jnp.arange(n + m - 1)
    k_rows, q_rows = _distance_rows(kr, qr, distances, buckets, one_hot=False, p2c_row=p2c_row)
    position = _position_logits(query.astype(cdt), key.astype(cdt), k_rows, q_rows)
  else:
    p = jnp.asarray(positions)
    pairs = _distance_rows(kr, qr, (p[:, None] - p[None, :]).reshape(-1), buckets,
                           one_hot=False, p2c_row=p2c_row)
    k_rows, q_rows = (r.reshape(n, m, *r.shape[1:]).astype(cdt) for r in pairs)
    position = (jnp.einsum('bnhd,nmhd->bhnm', query.astype(cdt), k_rows,
                           preferred_element_type=jnp.float32)
                + jnp.einsum('bmhd,nmhd->bhnm', key.astype(cdt), q_rows,
                             preferred_element_type=jnp.float32))
  position = position / np.sqrt(3 * d)
  if bias is not None:
    position = position + bias.astype(jnp.float32)
  # dot_product_attention divides q.k by sqrt(d); the extra 1/sqrt(3) makes it sqrt(3d).
  return dot_product_attention(
      query / np.sqrt(3.0).astype(query.dtype), key, value, mask=mask, bias=position,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, deterministic=deterministic,
      dtype=dtype, return_weights=return_weights)


def _third(x, tables, positions, origin):
  """q / sqrt(3) (Terms.transform_q): with the kernel's 1/sqrt(d), the
  paper's 1/sqrt(3d) on q.k and on content-to-position."""
  del tables, positions, origin
  return x / np.sqrt(3.0).astype(x.dtype)


def _score(s, block):
  """The two position terms of one block added to q.k; q arrives scaled by
  1/sqrt(3d) (_third), the Q^r rows scaled the same in _prepare."""
  k_rows, q_rows = (scheme.distance_slice(block.tables[name], block.tables['top'], block.q_pos,
                                           block.k_pos) for name in ('k_rows', 'q_rows'))
  return s + _position_logits(block.q, block.k, k_rows, q_rows)


def saturation(position_buckets: int, max_relative_positions: int, cap: int = 1 << 20):
  """An R with row_index(t) the same for every t >= R, and for every t <= -R
  (the clamped rows), or None if R would pass `cap`. From the float64 bucket
  one past the clamp, so that float32's rounding (a bucket at most one lower)
  cannot move it."""
  mid = position_buckets // 2
  if mid == 1:  # every |t| >= 1 is bucket +-1
    return 2
  # mid + ceil(x (mid - 1)) >= s + 1 where x = log(a / mid) / log((max - 1) / mid).
  exponent = (position_buckets - mid) / (mid - 1)
  log_a = np.log(mid) + exponent * np.log((max_relative_positions - 1) / mid)
  return int(np.exp(log_a)) + 2 if log_a < np.log(cap) else None


def _prepare(buckets, p2c_row, params, q_pos, k_pos):
  """The call's tables (Terms.prepare): the K^r and Q^r rows of every
  distance its blocks meet, looked up once by a one-hot matmul (a
  deterministic gradient); each block slices its own. Distances past
  `saturation` share one row, so the table stops there, plus a block's
  distances (q_pos [nq, bq], k_pos [nk, bk]: a block's clamped slice then
  still reads only that row): O(buckets + block) rows at any length. Also
  K^r and Q^r / sqrt(3d) themselves, [2s, h, d], for the lookups."""
  kr, qr = position_projections(params['rel_embeddings'], params['position_key_kernel'],
                                params['position_query_kernel'])
  top, distances = scheme.distance_range(q_pos, k_pos)
  far = saturation(*buckets)
  if far is not None:
    bound = far + q_pos.shape[-1] + k_pos.shape[-1] - 2  # + a block's distances
    if 2 * bound + 1 < distances.shape[0]:
      top, distances = jnp.asarray(bound, jnp.float32), bound - jnp.arange(2 * bound + 1)
  k_rows, q_rows = _distance_rows(kr, qr, distances, buckets, one_hot=True, p2c_row=p2c_row)
  third = np.sqrt(3 * kr.shape[-1])
  return {'k_rows': k_rows, 'q_rows': q_rows / third, 'top': top, 'kr': kr, 'qr': qr / third}


def _c2p_rows(q, k, tables):
  """q_i . K^r_r for every query and row r of P -> float32 [b, h, n, 2s]
  (a per-query Lookup); q arrives scaled by 1/sqrt(3d)."""
  del k
  return jnp.einsum('bnhd,rhd->bhnr', q, tables['kr'].astype(q.dtype),
                    preferred_element_type=jnp.float32)


def _p2c_rows(q, k, tables):
  """k_j . Q^r_r / sqrt(3d) for every key and row r, per query head ->
  float32 [b, h, m, 2s] (a per-key Lookup; k has its own g heads)."""
  del q
  qr = tables['qr']
  return jnp.einsum('bmhd,rhd->bhmr', product.repeat_heads(k, qr.shape[1]), qr.astype(k.dtype),
                    preferred_element_type=jnp.float32)


def _row_of(buckets, sign, q_pos, k_pos):
  """The row of P each pair reads, of sign * (p_i - j) (a Lookup's index)."""
  return row_index(sign * (q_pos - k_pos), *buckets)


def _terms(num_heads, *, position_buckets, max_relative_positions, p2c_row):
  del num_heads  # the parameters carry the heads
  buckets = (position_buckets, max_relative_positions)
  prepare = functools.partial(_prepare, buckets, p2c_row)
  lookups = (scheme.Lookup('query', _c2p_rows, functools.partial(_row_of, buckets, 1)),
             scheme.Lookup('key', _p2c_rows,
                           functools.partial(_row_of, buckets, P2C_ROWS[p2c_row])))
  return scheme.Terms(block_score=_score, prepare=prepare, transform_q=_third, lookups=lookups)


def _params(num_heads, head_dim, kwargs):
  width = num_heads * head_dim
  projection = nn.initializers.normal(width ** -0.5)
  return {'rel_embeddings': ((2 * kwargs['position_buckets'], width),
                             nn.initializers.normal(0.02), ('relative', 'embed')),
          'position_key_kernel': ((width, num_heads, head_dim), projection,
                                  ('embed', 'heads', 'kv')),
          'position_query_kernel': ((width, num_heads, head_dim), projection,
                                    ('embed', 'heads', 'kv'))}


@dataclasses.dataclass(frozen=True)
class DebertaOptions:
  """DeBERTa's options.

  position_buckets: s, the table P's 2s rows; offsets shorter than s/2 keep
    their own row; >= 2.
  max_relative_positions: longer offsets share log-spaced rows up to this;
    > position_buckets / 2 + 1, else the log-spaced range is empty.
  p2c_row: the position-to-content row, 'released' (of p_i - j, as the
    released code and published weights) or 'paper' (eq. 4's j - p_i).
  """
  position_buckets: int = 256
  max_relative_positions: int = 512
  p2c_row: str = 'released'

  def __post_init__(self):
    registry.check_int(self, 'position_buckets')
    registry.check_int(self, 'max_relative_positions')
    s, top = self.position_buckets, self.max_relative_positions
    if s < 2:
      raise ValueError(f'attention_kwargs.position_buckets={s}; must be >= 2')
    registry.check_choice(self, 'p2c_row', P2C_ROWS,
                          "the released code's row of i - j, or eq. 4's j - i")
    if top <= s // 2 + 1:
      raise ValueError(f'attention_kwargs.max_relative_positions={top}; must be > '
                       f'{s // 2 + 1} (position_buckets / 2 + 1 for position_buckets={s})')


registry.register(registry.AttentionVariant(
    name='deberta',
    models=registry.TRANSFORMER_MODELS,
    fn=deberta_attention,
    terms=_terms,
    options=DebertaOptions,
    params=_params,
    doc='disentangled content-to-content, content-to-position and position-to-content '
        'terms over log-bucketed offsets, scale 1/sqrt(3d) (DeBERTa, He et al. 2021); '
        "p2c_row: 'released' (the released code's row of i - j) or 'paper' (eq. 4's j - i)"))
