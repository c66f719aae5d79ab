"""The README's fenced commands run as written, so that the README cannot rot.

Every line of a ```bash block that starts with ./launch.sh is run through
launch.sh (the venv that runs these tests, so nothing is installed): a
command that trains gets tiny model and step overrides appended (later
overrides win) and a workdir under tmp_path; everything else runs as it is.
`./launch.sh test` is this suite. The error examples (the $-lines of the
plain ``` block after "Bad values") must print the error shown under them.
"""
import csv
import json
import os
import re
import shlex
import sys
import subprocess

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, 'README.md')

# Appended to a training command, per experiment: seconds instead of minutes.
TINY_MODEL = ['--config.model.d_model=16', '--config.model.num_heads=2',
              '--config.model.mlp_dim=32', '--config.model.num_decoder_layers=1',
              '--config.train.num_steps=2', '--config.train.log_every=1',
              '--config.train.eval_every=2', '--config.train.checkpoint_every=2']
TINY = {
    'experiments/reverse.py': TINY_MODEL + [
        '--config.model.num_encoder_layers=1', '--config.data.max_len=5',
        '--config.data.num_train=64', '--config.data.num_eval=8', '--config.train.batch_size=8',
        '--config.eval.batch_size=8'],
    'experiments/tiny_shakespeare_long.py': TINY_MODEL + [
        '--config.data.max_len=64', '--config.model.max_len=256', '--config.train.batch_size=2',
        '--config.eval.contexts=(128,)', '--config.eval.batch_tokens=2048',
        '--config.eval.sample_prompt=32', '--config.eval.sample_len=8'],
    # The pretrained model's own sizes (model.* from the command line would be
    # kept), evaluated as fetched: fine-tuning from a GGUF, eval.at_start
    # included, is tests/test_pretrained.py's (a tiny file).
    'experiments/tiny_shakespeare.py': TINY_MODEL + [
        '--config.data.max_len=96', '--config.model.max_len=96', '--config.train.batch_size=2',
        '--config.eval.batch_size=2', '--config.eval.max_examples=2',
        '--config.eval.sample_len=8'],
    'experiments/smollm2_shakespeare.py': [
        '--config.data.max_len=16', '--config.train.num_steps=0', '--config.eval.batch_size=2',
        '--config.eval.max_examples=2', '--config.eval.sample_prompt=8',
        '--config.eval.sample_len=4'],
}


def fenced(text: str, language: str) -> list[list[str]]:
  """The blocks fenced as ```language (a bare ``` for ''), each as its lines."""
  blocks, current, kind = [], None, None
  for line in text.split('\n'):
    if line.startswith('```') and current is None:
      current, kind = [], line[3:].strip()
    elif line.startswith('```'):
      if kind == language:
        blocks.append(current)
      current = None
    elif current is not None:
      current.append(line)
  return blocks


def launch_commands(text: str) -> list[str]:
  """The ./launch.sh lines of the ```bash blocks: continuations joined,
  trailing comments dropped."""
  commands = []
  for block in fenced(text, 'bash'):
    joined = '\n'.join(block).replace('\\\n', ' ')
    for line in joined.split('\n'):
      line = line.split(' #')[0].strip()
      if line.startswith('./launch.sh'):
        commands.append(' '.join(line.split()))
  return commands


def _trains(argv: list[str]) -> bool:
  rest = argv[1:]
  return not rest or rest[0].endswith('.py') or rest[0].startswith('--config.') or (
      rest[0].startswith('--devices'))


def _experiment(argv: list[str]) -> str:
  return argv[1] if len(argv) > 1 and argv[1].endswith('.py') else 'experiments/reverse.py'


def _launch(argv, env, timeout=600):
  return subprocess.run(['bash', os.path.join(REPO, 'launch.sh'), *argv[1:]], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope='module')
def env(shared_data, tfds_dir):
  """launch.sh on the venv that runs these tests (or FFL_PYTHON's interpreter,
  when the suite runs in it), the real corpora found where the README says
  (FFL_SHARED_DATA), a scratch TFDS folder."""
  found = dict(os.environ, FFL_SHARED_DATA=shared_data, TFDS_DATA_DIR=tfds_dir)
  if os.environ.get('FFL_PYTHON'):
    return found
  venv = os.path.join(REPO, '.venv')
  if not os.path.isfile(os.path.join(venv, '.pyproject.sha256')):
    pytest.skip(f'{venv} was not made by launch.sh (it would install a new one)')
  return dict(found, FFL_VENV=venv)


# Printed by JAX on a host without a TPU, and by tfds for every builder config
# its class does not list: nothing a user could act on.
NOISE = ('libtpu', 'Unable to initialize backend', 'SyntheticConfig')


def _quick_start_logs(done, workdir):
  """Progress on stdout (`./launch.sh > run.log` keeps it), none on stderr, no
  noise. (The same command resuming: tests/train/test_faults.py.)"""
  assert 'step 2/2' in done.stdout and 'sequence_accuracy' in done.stdout
  assert 'step 2/2' not in done.stderr
  for noise in NOISE:
    assert noise not in done.stderr + done.stdout, noise
  metrics = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [m['step'] for m in metrics if m['split'] == 'train'] == [1, 2]


COMMANDS = launch_commands(open(README).read())
# The quick start's run, then each command that reads it (the plot), in one test.
QUICK_START = ['./launch.sh'] + [c for c in COMMANDS if 'workdirs/reverse' in c]
# "Writing a variant"'s run of the module it shows, then the plot of that run.
VARIANT_RUN = 'workdirs/learned_alibi'
VARIANT = [c for c in COMMANDS if VARIANT_RUN in c]
ON_THEIR_OWN = [c for c in COMMANDS if c not in QUICK_START + VARIANT
                and shlex.split(c)[1:2] != ['test']]  # test: this suite


def _run_as_written(command, env, tmp_path, runs):
  """Runs one README command (a training one tiny, in a workdir under
  tmp_path; one that names a workdir of `runs`, {README's workdir: this
  test's}, in that one); returns the finished process."""
  argv = shlex.split(command)
  if _trains(argv):
    experiment = _experiment(argv)
    assert experiment in TINY, f'add tiny overrides for {experiment} ({command})'
    named = [run for readme_dir, run in runs.items() if f'--workdir={readme_dir}' in argv]
    workdir = (runs['workdirs/reverse'] if command == './launch.sh' else
               named[0] if named else tmp_path / 'run')
    argv = argv + TINY[experiment] + [f'--workdir={workdir}']
  else:
    for readme_dir, run in runs.items():
      argv = [a.replace(readme_dir, str(run)) for a in argv]
  done = _launch(argv, env)
  assert done.returncode == 0, f'{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}'
  assert 'Traceback' not in done.stderr, f'{command}\n{done.stderr[-3000:]}'
  if _trains(argv):
    assert os.path.isfile(os.path.join(argv[-1].split('=', 1)[1], 'metrics.jsonl')), command
  return done


def test_readme_has_the_quick_start():
  assert './launch.sh' in COMMANDS and './launch.sh test' in COMMANDS
  assert len(QUICK_START) >= 2, 'the README shows no plot of the quick start\'s run'


def test_quick_start_and_its_plot_run_as_written(env, tmp_path):
  quick_start = tmp_path / 'quick_start'
  for command in QUICK_START:
    done = _run_as_written(command, env, tmp_path, {'workdirs/reverse': quick_start})
    if command == './launch.sh':
      _quick_start_logs(done, quick_start)
  assert list((quick_start / 'attention').glob('*.png')), 'the plot command wrote no figure'


@pytest.mark.parametrize('command', ON_THEIR_OWN)
def test_readme_command_runs_as_written(command, env, tmp_path):
  """Each README command apart from the quick start's is its own test, so
  that pytest-xdist's workers share them."""
  done = _run_as_written(command, env, tmp_path, {'workdirs/reverse': tmp_path / 'quick_start'})
  if 'smollm2_shakespeare' in command:
    _pretrained_before_and_after(done, tmp_path / 'run')
  if 'flaxformer_lite.embed' in command:
    _similarity_matrix(done, shlex.split(command)[4:])
  if '--config.model.mask=' in command:
    _mask_by_name(command, tmp_path / 'run')


def _mask_by_name(command, workdir):
  """A run given a registered mask records it, trains, evaluates and samples."""
  saved = json.loads((workdir / 'config.json').read_text())['model']
  mask = re.search(r'--config\.model\.mask=(\w+)', command).group(1)
  assert saved['mask'] == mask and saved['mask_kwargs']['prefix_len'] is not None, saved
  metrics = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert {m['split'] for m in metrics} >= {'train', 'eval'}, metrics
  assert (workdir / 'sample.txt').read_text().strip()


def _similarity_matrix(done, texts):
  """The embed command's table: a row per text ending with it, the cosine
  similarities symmetric with ones on the diagonal, the related pair closer."""
  lines = done.stdout.splitlines()
  assert 'embedding dimension 384' in lines[0], done.stdout
  assert lines[1].split() == [str(i) for i in range(len(texts))] and len(lines) == 2 + len(texts)
  rows = []
  for i, (line, text) in enumerate(zip(lines[2:], texts)):
    assert line.endswith(f'  {text}'), line
    number, *values = line[:-len(text)].split()
    assert int(number) == i
    rows.append([float(v) for v in values])
  sims = np.array(rows)
  np.testing.assert_allclose(sims, sims.T, atol=1e-4)
  np.testing.assert_allclose(np.diag(sims), 1.0, atol=1e-4)
  assert sims[0, 1] > 0.5 > max(sims[0, 2], sims[1, 2])  # food/pasta close, the baby not
  # the columns line up: every value ends where its column number does
  ends = [m.end() for m in re.finditer(r'\d', lines[1])]
  for line in lines[2:]:
    assert [m.end() for m in re.finditer(r'-?\d\.\d{4}', line)] == ends, line


def _pretrained_before_and_after(done, workdir):
  """The SmolLM2 experiment: the fetched model by name, its own tokenizer, an
  evaluation at step 0 with a sample."""
  log = done.stdout + done.stderr
  assert 'models/smollm2/model.gguf' in log and 'vocab_size=49152' in log, log[-3000:]
  evals = {m['step']: m for m in map(json.loads, (workdir / 'metrics.jsonl').read_text()
                                                 .splitlines()) if m['split'] == 'eval'}
  assert sorted(evals) == [0], evals
  # the pretrained weights, not random ones (a random 49,152-way LM is near 49,152)
  assert evals[0]['perplexity'] < 1000, evals
  assert log.count('\n  greedy ') == 1 and (workdir / 'sample.txt').read_text().strip()


def test_readme_variant_runs_by_name_and_its_plot_reads_the_run(env, tmp_path):
  """"Writing a variant"'s module, saved as the README says (here on
  PYTHONPATH), named on the command line as written: the run trains the
  variant and records the module in config.json, and plot_attention, which
  reads the workdir alone, draws that run's maps."""
  assert len(VARIANT) >= 2, 'the README shows no command line, or no plot, for its variant'
  module = re.search(r'--config\.model\.import_modules=(\w+)', VARIANT[0]).group(1)
  block, = [b for b in fenced(open(README).read(), 'python')
            if 'registry.register' in '\n'.join(b)]
  (tmp_path / 'modules').mkdir()
  (tmp_path / 'modules' / f'{module}.py').write_text('\n'.join(block))
  env = dict(env, PYTHONPATH=str(tmp_path / 'modules'))
  run = tmp_path / 'learned_alibi'
  for command in VARIANT:
    done = _run_as_written(command, env, tmp_path, {VARIANT_RUN: run})
    if command == VARIANT[0]:
      assert 'attention=learned_alibi' in done.stdout, done.stdout[-3000:]
  saved = json.loads((run / 'config.json').read_text())['model']
  assert (saved['attention'], saved['import_modules']) == ('learned_alibi', module)
  assert list((run / 'attention').glob('*.png')), 'the plot command wrote no figure'


def test_readme_error_examples_print_what_they_show(env):
  (block,) = [b for b in fenced(open(README).read(), '') if any(l.startswith('$ ') for l in b)]
  examples = [(line[2:], block[i + 1]) for i, line in enumerate(block) if line.startswith('$ ')]
  assert len(examples) >= 2
  for command, shown in examples:
    done = _launch(shlex.split(command), env)
    assert done.returncode == 2, command
    errors = [line for line in done.stderr.splitlines() if line.startswith('error:')]
    assert errors and errors[0].startswith(shown.split('...')[0].rstrip()), (command, errors)


def test_readme_variant_example_registers_and_equals_its_formula():
  """The ```python block that registers a variant, run as written: the
  variant it adds runs on the derived dense path, the chunked kernel and the
  (interpreted) Pallas kernel, each equal to softmax(q.k / sqrt(d) -
  softplus(s_h) |i - j|) v in float64, and the slopes' gradient of the
  fused kernel equals the dense path's."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flaxformer_lite.attention import masks, registry
  block, = [b for b in fenced(open(README).read(), 'python') if 'registry.register' in '\n'.join(b)]
  exec('\n'.join(block), {})  # pylint: disable=exec-used
  try:
    variant = registry.get('learned_alibi')
    r = np.random.default_rng(0)
    b, n, h, d = 2, 7, 3, 4
    q, k, v = (r.normal(size=(b, n, h, d)).astype(np.float32) for _ in range(3))
    slopes = r.normal(size=(h,)).astype(np.float32)
    i = np.arange(n)
    s = (np.einsum('bnhd,bmhd->bhnm', q, k) / np.sqrt(d)
         - np.log1p(np.exp(slopes))[:, None, None] * np.abs(i[:, None] - i[None, :]))
    s = np.where(i[None, None, :, None] >= i[None, None, None, :], s, -np.inf)  # causal
    w = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum('bhnm,bmhd->bnhd', w / w.sum(-1, keepdims=True), v)
    dense = variant.fn(q, k, v, mask=jnp.asarray(np.tril(np.ones((n, n), bool))),
                       my_slopes=slopes)
    chunked = variant.chunked(q, k, v, mask=masks.causal(), chunk_size=3,
                              my_slopes=slopes)
    from flaxformer_lite.attention import attend
    fused = attend(q, k, v, scheme='learned_alibi', mask=masks.causal(), kernel='pallas',
                   params={'my_slopes': slopes})
    for what, x in (('dense', dense), ('chunked', chunked), ('pallas', fused)):
      np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5, atol=1e-5, err_msg=what)
    d_slopes = {kernel: jax.grad(lambda s, kernel=kernel: jnp.sum(attend(
        q, k, v, scheme='learned_alibi', mask=masks.causal(), kernel=kernel,
        params={'my_slopes': s}) ** 2))(jnp.asarray(slopes)) for kernel in ('dense', 'pallas')}
    np.testing.assert_allclose(np.asarray(d_slopes['pallas']), np.asarray(d_slopes['dense']),
                               rtol=1e-4, atol=1e-5)
  finally:
    registry._REGISTRY.pop('learned_alibi', None)  # pylint: disable=protected-access


def test_readme_inline_score_runs_on_every_kernel_as_its_formula():
  """The ```python block with an inline score (soft-capping), run as written
  with q, k, v given: on the dense, blockwise and (interpreted) Pallas
  kernels, output and q's gradient equal softmax(30 tanh(q.k / 30 sqrt(d)))
  v under a causal mask, written out in float64 (the gradient by central
  differences of that formula along one direction)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  block, = [b for b in fenced(open(README).read(), 'python') if 'score=softcap' in '\n'.join(b)]
  assert len([line for line in block if line.strip()]) <= 6
  r = np.random.default_rng(0)
  b, n, h, d = 2, 7, 2, 16
  q, k, v = (r.normal(size=(b, n, h, d)) * 3 for _ in range(3))

  def formula(q):
    s = 30.0 * np.tanh(np.einsum('bnhd,bmhd->bhnm', q, k) / np.sqrt(d) / 30.0)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum('bhnm,bmhd->bnhd', w / w.sum(-1, keepdims=True), v)

  scope = {'q': q.astype(np.float32), 'k': k.astype(np.float32), 'v': v.astype(np.float32)}
  exec('\n'.join(block), scope)  # pylint: disable=exec-used
  np.testing.assert_allclose(np.asarray(scope['out']), formula(q), rtol=1e-4, atol=1e-4)
  direction, eps = r.normal(size=q.shape), 1e-4
  cot = r.normal(size=q.shape)
  want = np.sum((formula(q + eps * direction) - formula(q - eps * direction)) * cot) / (2 * eps)
  for kernel in ('dense', 'chunked', 'pallas'):
    def loss(q, kernel=kernel):
      out = scope['attend'](q, *(jnp.asarray(x, jnp.float32) for x in (k, v)),
                            score=scope['softcap'], mask=scope['masks'].causal(), kernel=kernel,
                            options={'chunk_size': 4})
      return jnp.sum(out * cot), out
    (_, out), dq = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(q, jnp.float32))
    np.testing.assert_allclose(np.asarray(out), formula(q), rtol=1e-4, atol=1e-4, err_msg=kernel)
    np.testing.assert_allclose(float(np.sum(np.asarray(dq, np.float64) * direction)), want,
                               rtol=1e-3, err_msg=kernel)


def test_the_generated_parts_match_the_live_registry_and_the_results_files():
  """README.md's variant count, variants table and headline table, and the
  results tables of benchmarks/RESULTS.md, benchmarks/KERNELS.md and
  tests/README.md, are what benchmarks/readme_tables.py writes from the
  registry and benchmarks/results/ today."""
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import readme_tables
  assert readme_tables.main(['--check']) == 0, 'run ./launch.sh run benchmarks/readme_tables.py'


def test_the_readme_check_fails_on_a_stale_count_row_or_number(tmp_path, capsys):
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import readme_tables
  from flaxformer_lite.attention import registry
  # hand-written words, not the script's own table
  assert [readme_tables.number_word(n) for n in (7, 16, 21, 40, 99)] == [
      'Seven', 'Sixteen', 'Twenty-one', 'Forty', 'Ninety-nine']
  with open(os.path.join(REPO, 'README.md')) as f:
    readme = f.read()
  count = readme_tables.number_word(len(registry.names()))
  assert f'attention variants. {count}\n' in readme
  row = next(line for line in readme.splitlines() if line.startswith('| `alibi` |'))
  multi30k = readme_tables.load_measurements()['multi30k_cpu']['values']['test_bleu']
  assert f'BLEU {multi30k:.1f}' in readme
  for stale in (readme.replace(f'variants. {count}\n', 'variants. Sixteen\n'),
                readme.replace(row + '\n', ''),
                readme.replace(row, row.replace('dense, chunked', 'dense')),
                readme.replace(f'BLEU {multi30k:.1f}', f'BLEU {multi30k + 1:.1f}')):
    path = tmp_path / 'README.md'
    path.write_text(stale)
    assert readme_tables.main(['--check', '--readme', str(path)]) == 1
  assert 'differ from what benchmarks/readme_tables.py writes' in capsys.readouterr().out


def test_a_new_measurement_reaches_the_documents_through_its_record():
  """A record's value changes the headline and its row in benchmarks/RESULTS.md;
  every record has its row in one of the documents, naming its machine and date."""
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import readme_tables
  measurements = readme_tables.load_measurements()
  changed = json.loads(json.dumps(measurements))
  changed['tiny_shakespeare_cpu']['values']['eval_loss'] = 1.234
  changed['tiny_shakespeare_cpu']['wall'] = '9m99s'
  for name in ('README.md', os.path.join('benchmarks', 'RESULTS.md')):
    with open(os.path.join(REPO, name)) as f:
      text = f.read()
    assert '1.234' not in text
    new = readme_tables.generate(text, changed)
    assert 'val loss 1.234' in new or 'val loss **1.234**' in new, name
    assert '9m99s' in new, name
  text = ''
  for name in readme_tables.FILES[1:]:
    with open(os.path.join(REPO, name)) as f:
      text += f.read()
  for record in measurements.values():
    assert f'{record["machine"]}, {record["wall"]}, {record["date"]} |' in text
  with pytest.raises(KeyError, match='no value'):
    readme_tables.fill('{missing:.2f}', measurements['multi30k_cpu'])
  with pytest.raises(ValueError, match='no section'):
    readme_tables.include('position_study/tables.md#no such study')
  with pytest.raises(ValueError, match='no record with table'):
    readme_tables.records_table('no_such_table', measurements)


def _csv_mean(path, study, row, metric):
  values = []
  with open(path, newline='') as f:
    for r in csv.DictReader(f):
      if (r['study'], r['row'], r['metric']) == (study, row, metric):
        values.append(float(r['value']))
  return sum(values) / len(values)


def test_the_headline_numbers_are_the_results_files_numbers():
  """Read from the committed results by this test's own arithmetic, not the
  generator's."""
  with open(os.path.join(REPO, 'README.md')) as f:
    readme = f.read()
  results = os.path.join(REPO, 'benchmarks', 'results')
  study = os.path.join(results, 'position_study', 'results.csv')
  for row, name in (('sinusoidal', 'sinusoidal'), ('shaw_k16', 'Shaw'), ('rotary', 'rotary')):
    assert f'{name} {_csv_mean(study, "multi30k", row, "test.bleu"):.1f} ± ' in readme
  suite = os.path.join(results, 'length_generalisation_suite', 'results.csv')
  cells = {}
  with open(suite, newline='') as f:
    for r in csv.DictReader(f):
      if r['metric'] == 'test.accuracy':
        cells.setdefault((r['study'], r['row']), []).append(float(r['value']))
  learned = sum(sum(v) / len(v) >= 0.90 for v in cells.values())
  assert f'{learned} of {len(cells)} cells learned' in readme
  relative = os.path.join(results, 'length_generalisation', 'results.csv')
  xl = _csv_mean(relative, 'reverse', 'transformer_xl', 'test.long_sequence_accuracy')
  assert f'Transformer-XL {xl:.2f}' in readme


def test_an_experiments_expected_lines_say_what_its_record_measured():
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import readme_tables
  measurements = readme_tables.load_measurements()
  tied = {r['experiment'] for r in measurements.values() if 'experiment' in r}
  assert {'experiments/reverse.py', 'experiments/tiny_shakespeare_cpu.py',
          'experiments/smollm2_shakespeare.py'} <= tied
  assert readme_tables.stale_expectations(measurements) == []
  changed = json.loads(json.dumps(measurements))
  changed['tiny_shakespeare_cpu']['values']['eval_loss'] = 1.5
  problems = readme_tables.stale_expectations(changed)
  assert len(problems) == 1 and 'experiments/tiny_shakespeare_cpu.py' in problems[0]
  assert "'1.500'" in problems[0]


def test_readme_mask_example_runs_on_both_kernels_as_its_definition(monkeypatch):
  """The ```python block that writes a mask, run as written: through
  MultiHeadAttention on the dense, the chunked and the (interpreted) Pallas
  kernel, each equal to the layer given the mask as a boolean array built
  here by loops; the chunked kernel visits exactly the blocks some row of
  that array needs (counted through blockwise.VISIT_HOOK)."""
  import collections
  from flaxformer_lite.attention.kernels import blockwise
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flaxformer_lite.layers import MultiHeadAttention
  block, = [b for b in fenced(open(README).read(), 'python') if 'masks.Mask(' in '\n'.join(b)]
  scope = {}
  exec('\n'.join(block), scope)  # pylint: disable=exec-used
  lengths = np.array([3, 0])
  b, n = 2, 9
  want = np.zeros((b, 1, n, n), bool)
  for row in range(b):
    for i in range(n):
      for j in range(n):
        want[row, 0, i, j] = j <= i or j < lengths[row]
  x = jnp.asarray(np.random.default_rng(0).normal(size=(b, n, 8)), jnp.float32)
  outs, visits = {}, collections.Counter()
  for kernel in ('dense', 'chunked', 'pallas'):
    layer = MultiHeadAttention(num_heads=2, attention='alibi',
                               attention_kwargs={'kernel': kernel, 'chunk_size': 4})
    params = layer.init(jax.random.key(0), x)
    if kernel == 'chunked':
      monkeypatch.setattr(blockwise, 'VISIT_HOOK', lambda pass_name, masked, qb, kb: visits.update(
          [(pass_name, int(qb), int(kb))]))
    outs[kernel] = layer.apply(params, x, mask=scope['prefix_lm'](lengths))  # numpy data
    jax.effects_barrier()
    monkeypatch.setattr(blockwise, 'VISIT_HOOK', None)
    outs[kernel + ' from the array'] = layer.apply(params, x, mask=jnp.asarray(want))
  for kernel in ('dense', 'chunked', 'pallas'):
    np.testing.assert_allclose(np.asarray(outs[kernel]), np.asarray(outs['dense from the array']),
                               rtol=1e-5, atol=1e-5, err_msg=kernel)
  needed = {(qb, kb) for qb in range(3) for kb in range(3)
            if want[:, :, 4 * qb:4 * qb + 4, 4 * kb:4 * kb + 4].any()}
  assert len(needed) < 9  # the mask hides some blocks
  assert {(qb, kb) for _, qb, kb in visits} == needed and set(visits.values()) == {1}, visits
