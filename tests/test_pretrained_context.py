"""benchmarks/pretrained_context.py: the passkey prompt against its text
written out by hand, the perplexity against a log-softmax of the model's own
logits, the teacher-forced passkey check against greedy decoding, and the
script end to end on SmolLM2 (./launch.sh fetch smollm2) at a tiny size."""
import importlib.util
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import config as config_lib, decoding, models, pretrained
from flaxformer_lite.data import tokenizers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    'pretrained_context', os.path.join(REPO, 'benchmarks', 'pretrained_context.py'))
pc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pc  # its dataclasses look their module up while it loads
_spec.loader.exec_module(pc)


@pytest.mark.parametrize('length, key, depth', [(400, '12345', 0.0), (400, '90817', 0.37),
                                                (451, '55555', 1.0), (230, '10203', 0.5)])
def test_the_passkey_prompt_is_the_text_written_out(length, key, depth):
  """With one token a byte, token positions are character positions: the
  prompt is the instruction, the filler cut to length, the key sentence
  after the filler group nearest the depth, the question and the answer."""
  tok = tokenizers.ByteTokenizer()
  p = pc.passkey_prompt(tok, length, key, depth)
  assert p.ids.shape == (length,)
  hidden, answer = f' The pass key is {key}. Remember it.', f' {key}'
  fill = length - len(pc.INSTRUCTION) - len(hidden) - len(pc.QUESTION) - len(answer)
  unit = len(pc.FILLER)
  at = unit * min(round(depth * fill / unit), fill // unit)
  filler = (pc.FILLER * (fill // unit + 1))[:fill]
  want = pc.INSTRUCTION + filler[:at] + hidden + filler[at:] + pc.QUESTION + answer
  assert tok.decode(p.ids) == want
  prompt = tok.decode(p.ids[:-p.answer])
  assert prompt.count(key) == 1 and tok.decode(p.ids[-p.answer:]) == answer
  assert tok.decode(p.ids[p.key_at:]).startswith(hidden)
  assert abs(p.depth - depth) <= unit / fill and p.key_at == len(pc.INSTRUCTION) + at
  assert tok.decode(p.ids[p.digits]) == key and p.digits[0] == p.key_at + hidden.index(key)


def test_key_heads_are_those_that_look_from_the_answer_at_the_key():
  tok = tokenizers.ByteTokenizer()
  p = pc.passkey_prompt(tok, 240, '31415', 0.5)
  n = len(p.ids)
  uniform = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
  weights = {layer: np.stack([uniform] * 3) for layer in range(3)}
  queries = slice(n - p.answer - 1, n - 1)  # the positions that predict the answer
  weights[2][1][queries] = 0
  weights[2][1][queries, p.digits] = 1 / 5  # all on the key
  weights[0][2][queries] = 0
  weights[0][2][queries, p.digits[:2]] = 0.25  # half on it
  assert pc.key_heads(weights, p, 2) == [(2, 1), (0, 2)]


def test_passkey_trials_are_seeded_and_the_same_for_every_row():
  tok = tokenizers.ByteTokenizer()
  a, b = (pc.passkey_trials(tok, 300, 5, seed=3) for _ in range(2))
  assert [p.key for p in a] == [p.key for p in b] and all(len(p.key) == 5 for p in a)
  assert len({p.key for p in a}) == 5
  assert [p.key for p in pc.passkey_trials(tok, 300, 5, seed=4)] != [p.key for p in a]
  with pytest.raises(ValueError, match='needs at least 214 tokens, not 50'):
    pc.passkey_prompt(tok, 50, '12345', 0.5)


def _tiny():
  c = config_lib.base_config().model
  c.update(type='decoder_only', vocab_size=40, d_model=16, num_heads=2, num_kv_heads=1,
           num_encoder_layers=0, num_decoder_layers=2, mlp_dim=32, positions='none',
           attention='rotary', max_len=64)
  shapes = jax.eval_shape(models.build(c).init, jax.random.key(0),
                          jnp.ones((1, 4), jnp.int32))['params']
  rng = np.random.default_rng(0)  # random parameters: no init to compile
  return c, jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(np.float32), shapes)


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1,
                                                                                      keepdims=True))


def test_perplexity_is_the_mean_log_softmax_of_the_next_tokens():
  c, params = _tiny()
  model = models.build(c)
  ids = np.random.default_rng(1).integers(3, 40, 40).astype(np.int32)
  got = pc.perplexity(pc.scorer(model), params, ids, length=8, eval_tokens=24)
  logits = np.asarray(jax.jit(model.apply)({'params': params}, ids[:24].reshape(3, 8)))
  nll = []
  for window, lp in zip(ids[:24].reshape(3, 8), _log_softmax(logits)):
    nll += [-lp[t, window[t + 1]] for t in range(7)]  # 3 windows of 8 within 24 tokens
  assert (got['windows'], got['tokens']) == (3, 21)
  np.testing.assert_allclose(got['nll'], np.mean(nll), rtol=1e-5)
  np.testing.assert_allclose(got['ppl'], math.exp(np.mean(nll)), rtol=1e-5)
  assert pc.windows(ids, 32, 8).shape == (1, 32)  # one window at least


def test_the_teacher_forced_check_is_greedy_decodings_exact_match():
  """ids = a prompt + the model's own greedy continuation: retrieved; one
  continuation token changed: not."""
  c, params = _tiny()
  prompt = np.random.default_rng(2).integers(3, 40, 10).astype(np.int32)
  generate = jax.jit(decoding.greedy_generate, static_argnums=(0, 3))
  greedy = np.asarray(generate(models.build(c, decode=True), params, prompt[None], 4))[0]
  assert 2 not in greedy  # no EOS, after which greedy pads
  score = pc.scorer(models.build(c))
  ids = np.concatenate([prompt, greedy])
  assert pc.retrieved(score(params, jnp.asarray(ids[None]))[1][0], 4)
  ids[-2] = 3 + (ids[-2] - 2) % 37  # another token
  assert not pc.retrieved(score(params, jnp.asarray(ids[None]))[1][0], 4)


def test_rows_set_rope_scaling():
  rows = pc.parse_rows(['none,linear2', 'yarn4'])
  assert [(r.name, r.scaling, r.factor) for r in rows] == [
      ('none', 'none', 1.0), ('linear2', 'linear', 2.0), ('yarn4', 'yarn', 4.0)]
  c, _ = _tiny()
  yarn = pc.row_config(c, rows[2], 8192).attention_kwargs
  assert (yarn.rope_scaling, yarn.rope_factor, yarn.rope_original_max_len,
          yarn.kernel) == ('yarn', 4.0, 8192, 'auto')
  assert c.attention_kwargs.rope_scaling is None  # the base config is left as it was
  with pytest.raises(ValueError, match="'pi2' is not a row"):
    pc.parse_rows(['none,pi2'])


def test_the_script_runs_end_to_end_on_smollm2(tmp_path, tfds_dir):
  try:
    path = pretrained.fetch('smollm2')
  except pretrained.PretrainedError as e:
    pytest.skip(f'smollm2 is not in {pretrained.cache_dir()} and could not be fetched: {e}')
  out = str(tmp_path / 'out')
  args = ['--model', path, '--lengths', '64', '--trials', '2', '--rows', 'none,linear2',
          '--eval_tokens', '128', '--data_dir', tfds_dir, '--out', out]
  assert pc.main(args + ['--tasks', 'perplexity', 'passkey', '--rows', 'none']) == 0
  assert pc.main(args + ['--tasks', 'perplexity']) == 0  # linear2's perplexity only: new
  records = [json.loads(line) for line in open(os.path.join(out, 'results.jsonl'))]
  assert sorted((r['task'], r['row']) for r in records) == [
      ('passkey', 'none'), ('perplexity', 'linear2'), ('perplexity', 'none')]
  ppl = {r['row']: r for r in records if r['task'] == 'perplexity'}
  assert ppl['none']['windows'] == 2 and ppl['none']['tokens'] == 126
  assert 1 < ppl['none']['ppl'] < ppl['linear2']['ppl'] < 1e4  # as trained is best
  table = open(os.path.join(out, 'tables.md')).read()
  assert '| none |' in table and '/2)' in table
  assert pc.main(args + ['--tasks', 'perplexity']) == 0  # resumed: nothing to run
  assert len(open(os.path.join(out, 'results.jsonl')).readlines()) == 3
  # A cell an earlier call made at another length (its own text: max(32, 128)
  # tokens) stays in the tables that a later call writes.
  earlier = dict(ppl['none'], length=32, ppl=12.5, nll=2.526)
  with open(os.path.join(out, 'results.jsonl'), 'a') as f:
    f.write(json.dumps(earlier) + '\n')
  assert pc.main(args + ['--tasks', 'perplexity']) == 0
  table = open(os.path.join(out, 'tables.md')).read()
  assert '| rope | 32 | 64 |' in table and '| none | 12.50 (2.526) |' in table
