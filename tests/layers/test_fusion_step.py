"""fusion_step (eq. 8-9) against a numpy loop, and the one path between streams."""
import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.layers import fusion

B, D = 2, 3


def _mixer(seed):
  """A toy layer that mixes tokens: t + tanh(mean over tokens of t @ W)."""
  w = np.random.default_rng(seed).normal(size=(D, D)).astype(np.float32)
  jax_fn = lambda t: t + jnp.tanh(jnp.mean(t, axis=1, keepdims=True) @ w)
  np_fn = lambda t: t + np.tanh(np.mean(t, axis=1, keepdims=True) @ w)
  return jax_fn, np_fn


def _inputs(seed, *lengths):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=(B, n, D)).astype(np.float32) for n in lengths]


def test_fusion_step_matches_numpy_loop_over_three_streams():
  layers = [_mixer(i) for i in range(3)]
  streams = _inputs(0, 4, 1, 3)
  z = _inputs(1, 2)[0]
  got_streams, got_z = fusion.fusion_step([l[0] for l in layers], streams, z)

  want_streams, updated = [], np.zeros_like(z)
  for (_, np_fn), x in zip(layers, streams):
    y = np_fn(np.concatenate([z, x], axis=1))
    want_streams.append(y[:, z.shape[1]:])
    updated += y[:, :z.shape[1]] / len(streams)
  for got, want in zip(got_streams, want_streams):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got_z), updated, atol=1e-6)


def _stream_a_after_two_steps(cut):
  """out_a after two fusion steps as a function of x_b. With `cut`, stream
  a's layers read the bottleneck tokens through stop_gradient."""
  (fa, _), (fb, _) = _mixer(0), _mixer(1)
  x_a, z = _inputs(2, 3, 2)
  num = z.shape[1]

  def read_a(t):
    if cut:
      t = jnp.concatenate([jax.lax.stop_gradient(t[:, :num]), t[:, num:]], axis=1)
    return fa(t)

  def out_a(x_b):
    streams, zz = [x_a, x_b], z
    for _ in range(2):
      streams, zz = fusion.fusion_step([read_a, fb], streams, zz)
    return streams[0]
  return out_a


def test_stream_b_reaches_stream_a_only_through_the_bottleneck():
  x_b = _inputs(3, 4)[0]
  intact = jax.jacobian(_stream_a_after_two_steps(cut=False))(x_b)
  cut = jax.jacobian(_stream_a_after_two_steps(cut=True))(x_b)
  assert np.abs(np.asarray(intact)).max() > 1e-3
  assert np.all(np.asarray(cut) == 0.0)
