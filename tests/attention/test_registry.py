"""The registry's option names: one name, one meaning, over every registered variant.

`config.model.attention_kwargs` holds the options of all variants at once, and
a value set for one variant stays set when the user swaps to another, so a
name that two variants take must mean the same thing in both: declared in
`registry.SHARED_OPTIONS`, with one default.
"""
import collections

import jax
import pytest

from flaxformer_lite.attention import registry, select


def _takers():
  """option name -> [(variant name, default)] over the live registry."""
  out = collections.defaultdict(list)
  for name in registry.names():
    for option, default in registry.get(name).kwargs.items():
      out[option].append((name, default))
  return out


def test_every_option_taken_twice_is_declared_shared_with_one_default():
  for option, takers in _takers().items():
    if len(takers) < 2:
      continue
    assert option in registry.SHARED_OPTIONS, (option, takers)
    defaults = {(type(d), d) for _, d in takers}
    assert len(defaults) == 1, (option, takers)


def test_every_declared_shared_option_is_taken_by_two_variants_and_explained():
  takers = _takers()
  for option, meaning in registry.SHARED_OPTIONS.items():
    assert len(takers[option]) >= 2, (option, takers[option])
    assert meaning.strip(), option


def test_all_kwargs_holds_each_variants_defaults():
  everything = registry.all_kwargs()
  for name in registry.names():
    for option, default in registry.get(name).kwargs.items():
      assert everything[option] == default and type(everything[option]) is type(default)


@pytest.fixture
def scratch_registry(monkeypatch):
  """The live registry's entries in a copy that the test may add to."""
  monkeypatch.setattr(registry, '_REGISTRY', dict(registry._REGISTRY))


def _fake(**kwargs):
  return registry.AttentionVariant(name='fake', fn=lambda *a, **k: None, kwargs=kwargs)


@pytest.mark.parametrize('option,default,other', [
    ('max_distance', 128, 'shaw'),  # T5's bucket range under shaw's k
    ('max_distance', 16, 'shaw'),  # same default, but not declared shared
    ('window', 8, 'local'),
    ('temperature', 1.0, 'hard'),
])
def test_register_rejects_an_undeclared_name_another_variant_takes(scratch_registry, option,
                                                                   default, other):
  with pytest.raises(ValueError, match='SHARED_OPTIONS') as e:
    registry.register(_fake(**{option: default}))
  message = str(e.value)
  assert repr(option) in message and "'fake'" in message and repr(other) in message
  assert 'fake' not in registry.names()


@pytest.mark.parametrize('option', sorted(registry.KERNEL_OPTIONS))
def test_register_rejects_a_kernel_option_as_a_variant_option(scratch_registry, option):
  """implementation and chunk_size choose the kernel for every variant; none may
  give them a meaning of its own."""
  with pytest.raises(ValueError, match='KERNEL_OPTIONS') as e:
    registry.register(_fake(**{option: registry.KERNEL_OPTIONS[option]}))
  assert repr(option) in str(e.value) and 'fake' not in registry.names()


@pytest.mark.parametrize('default', [4, 8.0, True])
def test_register_rejects_a_shared_name_with_another_default(scratch_registry, default):
  with pytest.raises(ValueError, match='half_window') as e:
    registry.register(_fake(half_window=default))
  assert "'fake'" in str(e.value) and 'luong_local_' in str(e.value)
  assert 'fake' not in registry.names()


def test_register_accepts_a_shared_name_with_its_default_and_new_names(scratch_registry):
  registry.register(_fake(half_window=8, fake_only_option=3))
  assert registry.resolve_kwargs('fake', {'half_window': 2}) == {
      'half_window': 2, 'fake_only_option': 3}


def test_scratch_registry_left_the_live_one_alone():
  assert 'fake' not in registry.names()


@pytest.mark.parametrize('variant,foreign,own', [
    ('t5_bias', 'max_distance', 'bucket_max_distance=128'),
    ('shaw', 'bucket_max_distance', 'max_distance=16'),
    ('luong_local_m', 'window', 'half_window=8'),
    ('luong_local_p', 'window', 'half_window=8'),
    ('local', 'half_window', 'window=8'),
])
def test_an_option_of_another_variant_is_refused_naming_the_valid_ones(variant, foreign, own):
  with pytest.raises(ValueError, match=rf"\['{foreign}'\].*{variant!r}.*{own}"):
    registry.resolve_kwargs(variant, {foreign: 4})


@pytest.mark.parametrize('name', registry.names())
def test_every_learned_table_declares_how_a_model_axis_shards_it(name):
  """Each table a variant declares names one logical axis (or None) per
  dimension, from the names partitioning.LOGICAL_RULES maps; per-head
  dimensions are called 'heads'."""
  from flaxformer_lite.train import partitioning
  variant = registry.get(name)
  if variant.params is None:
    return
  known = {axis for axis, _ in partitioning.LOGICAL_RULES}
  h, d = 3, 8
  for table, (shape, init, axes) in variant.params(h, d, registry.resolve_kwargs(name, None)).items():
    assert len(axes) == len(shape), (table, shape, axes)
    assert set(axes) - {None} <= known, (table, axes)
    for size, axis in zip(shape, axes):
      assert (axis == 'heads') == (size == h), (table, shape, axes)
    assert init(jax.random.key(0), shape).shape == tuple(shape)


# ---- the kernel 'auto' picks ----------------------------------------------------

def _pick(name, b, n, m, h=8, g=None, dtype='float32', decoding=False, return_weights=False,
          positions=False, **options):
  """The kernel 'auto' picks on CPU (select.py has every platform's)."""
  query = jax.ShapeDtypeStruct((b, n, h, 64), dtype)
  key = jax.ShapeDtypeStruct((b, m, g or h, 64), dtype)
  kernel = registry.resolve_kernel(name, options)
  with select.target_platform('cpu'):
    return registry.choose_kernel(registry.get(name), kernel, query, key, dtype=dtype,
                                  decoding=decoding, return_weights=return_weights,
                                  positions=positions)


@pytest.mark.parametrize('name', registry.chunked_names())
def test_auto_is_dense_up_to_256_mib_of_scores_on_cpu_then_chunked(name):
  """b * h * n * m scores of the compute dtype against the CPU's 256 MiB:
  8 heads of 512 x 512 float32 scores are 8 MiB a row, so 32 rows are at
  the threshold and 33 above it; bfloat16 halves the bytes; batch and heads
  count as much as length (b = 64, h = 16, n = 512: 1 GiB). An explicit
  dense_max_mib replaces the 256."""
  assert _pick(name, 32, 512, 512) == 'dense'
  assert _pick(name, 33, 512, 512) == 'chunked'
  assert _pick(name, 64, 512, 512, dtype='bfloat16') == 'dense'
  assert _pick(name, 65, 512, 512, dtype='bfloat16') == 'chunked'
  assert _pick(name, 4, 1024, 1024) == 'dense'  # 128 MiB
  assert _pick(name, 4, 2048, 2048) == 'chunked'  # 512 MiB
  assert _pick(name, 64, 512, 512, h=16) == 'chunked'
  assert _pick(name, 1, 4096, 4096, g=1) == 'chunked'  # the query heads count
  assert _pick(name, 8, 512, 512, dense_max_mib=64) == 'dense'
  assert _pick(name, 9, 512, 512, dense_max_mib=64) == 'chunked'
  assert _pick(name, 1, 16, 16, dense_max_mib=0) == 'chunked'
  assert _pick(name, 64, 512, 512, return_weights=True) == 'dense'  # only dense has them
  assert _pick(name, 64, 512, 512, implementation='dense') == 'dense'
  assert _pick(name, 1, 16, 16, implementation='chunked') == 'chunked'


@pytest.mark.parametrize('name', registry.chunked_names())
def test_auto_decodes_a_cache_longer_than_two_blocks_on_the_chunked_kernel(name):
  """One query against a cache: the chunked kernel stops at the cache index
  (causal bounds), the dense one reads all of it. Blocks of 512 on CPU."""
  assert _pick(name, 4, 1, 2048, decoding=True) == 'chunked'
  assert _pick(name, 4, 1, 1024, decoding=True) == 'dense'
  assert _pick(name, 4, 1, 1024, decoding=True, chunk_size=256) == 'chunked'
  assert _pick(name, 4, 1, 2048, decoding=False) == 'dense'


@pytest.mark.parametrize('name', sorted(set(registry.chunked_names())
                                         & set(registry.position_array_names())))
def test_positions_given_as_data_run_on_the_dense_kernel(name):
  """Randomized positions: the chunked forms' block terms may read a block's
  positions as a range, so such a call is dense whatever its size or option."""
  assert _pick(name, 64, 512, 512, h=16) == 'chunked'
  assert _pick(name, 64, 512, 512, h=16, positions=True) == 'dense'
  assert _pick(name, 1, 16, 16, implementation='chunked', positions=True) == 'dense'


def test_auto_keeps_variants_without_a_chunked_form_dense():
  for name in sorted(set(registry.names()) - set(registry.chunked_names())):
    assert _pick(name, 64, 512, 512, h=16) == 'dense', name
    assert _pick(name, 4, 1, 4096, decoding=True) == 'dense', name


def test_dense_max_mib_is_checked():
  with pytest.raises(ValueError, match='dense_max_mib=-1'):
    registry.resolve_kernel('dot_product', {'dense_max_mib': -1})
