"""benchmarks/fused_attention.py: a row per kernel asked for, measured side by
side with finite ratios; a kernel that does not build is listed, not raised;
each row held to the issue's targets at its length; an unknown scheme exits 2
naming the valid ones."""
import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'benchmarks'))
import fused_attention  # noqa: E402
from flaxformer_lite.attention import registry  # noqa: E402


def _cells(row: str) -> dict:
  """A markdown row of the table -> {column: cell}."""
  columns = ['n', 'b', 'd', 'kernel', *(c for c, _ in fused_attention.COLUMNS), 'target']
  return dict(zip(columns, (c.strip() for c in row.strip().strip('|').split('|'))))


def test_every_scheme_the_kernel_runs_is_a_case_and_shaw_is_two():
  fused = {n for n in registry.names() if registry.pallas_runs(registry.get(n))}
  assert set(fused_attention.cases()) == fused | {fused_attention.KEYS_ONLY}
  assert fused_attention.cases()['shaw/keys'] == ('shaw', {'relative_values': False})


def test_the_table_has_a_row_per_kernel_with_finite_ratios(capsys):
  rows = fused_attention.main(['--lengths', '32', '--head_dims', '16', '--heads', '2',
                               '--dtype', 'float32', '--repeats', '2',
                               '--schemes', 'alibi', 'shaw/keys'])
  printed = capsys.readouterr().out
  assert all(row in printed for row in rows)
  cells = {c['kernel']: c for c in map(_cells, rows)}
  assert {'pallas', 'xla', 'pallas alibi', 'pallas shaw/keys'} <= set(cells) <= (
      {'pallas', 'xla', 'cudnn', 'pallas alibi', 'pallas shaw/keys'})
  for kernel, c in cells.items():
    assert (c['n'], c['b'], c['d']) == ('32', '1', '16'), c
    for column in ('ms', 'x plain', 'x XLA', 'TFLOP/s', 'temp beyond tables x plain'):
      assert math.isfinite(float(c[column])) and float(c[column]) > 0, (kernel, column, c)
    assert float(c['temp MiB']) >= float(c['tables MiB']) >= 0, (kernel, c)
  assert float(cells['pallas']['x plain']) == 1.0 == float(cells['xla']['x XLA'])
  # Shaw's keys make q . a^K rows, [b, h, n, 2k + 1], and their gradients; ALiBi none
  assert float(cells['pallas shaw/keys']['tables MiB']) > 0
  assert float(cells['pallas alibi']['tables MiB']) == 0
  assert cells['pallas shaw/keys']['target'].startswith('x plain ')
  assert '<= 1.3' in cells['pallas shaw/keys']['target'] and cells['pallas alibi']['target'] == ''


def test_a_kernel_that_does_not_build_or_run_is_listed_with_why():
  q, k, v, g = fused_attention.inputs(8, 1, 2, 15, jnp.float32)
  steps, skipped = fused_attention.builds(q, k, v, g, ['rotary'], on_gpu=False,
                                          dense_limit_mib=0)
  assert set(steps) == {'pallas', 'pallas rotary'} and 'dense_limit_mib' in skipped['xla']

  def fails_when_run(x):
    raise RuntimeError('out of memory')

  @jax.jit
  def runs_out(q):  # compiles, and fails only when called
    return jax.pure_callback(fails_when_run, jax.ShapeDtypeStruct(q.shape, q.dtype), q)

  measured = fused_attention.measure(
      {'pallas rotary': steps['pallas rotary'], 'runs out': lambda: (runs_out, (q,))}, 1)
  assert measured['rounds'] == {} == measured['temp']
  assert 'even head_dim' in measured['failed']['pallas rotary']
  assert measured['failed']['runs out'].startswith('JaxRuntimeError'), measured['failed']


def test_each_target_holds_at_its_lengths_and_is_judged_on_a_gpu():
  values = {'x plain': 1.6, 'x XLA': 0.2, 'temp beyond tables x plain': 1.1}
  at_8k = fused_attention.targets('pallas shaw', 8192, values, judged=True)
  assert at_8k == 'x plain 1.60 <= 1.5: FAIL; x XLA 0.20 <= 0.3: pass'
  at_32k = fused_attention.targets('pallas shaw', 32768, values, judged=True)
  assert 'x XLA' not in at_32k and 'temp beyond tables x plain 1.10 <= 1.2: pass' in at_32k
  assert 'pass' not in fused_attention.targets('pallas shaw', 8192, values, judged=False)
  assert fused_attention.targets('pallas', 2048, {}, judged=True) == (
      'x cuDNN <= 1.1: not measured')
  assert fused_attention.targets('pallas alibi', 8192, values, judged=True) == ''


def test_an_unknown_scheme_exits_2_naming_the_valid_ones(capsys):
  with pytest.raises(SystemExit) as exit_:
    fused_attention.parse(['--schemes', 'alibi', 'no_such_scheme'])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert 'no_such_scheme' in err and all(name in err for name in fused_attention.cases())
