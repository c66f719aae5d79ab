"""The registry's option names: one name, one meaning, over every registered variant.

`config.model.attention_kwargs` holds the options of all variants at once, and
a value set for one variant stays set when the user swaps to another, so a
name that two variants take must mean the same thing in both: declared in
`registry.SHARED_OPTIONS`, with one default.
"""
import collections
import dataclasses
import re
import typing

import jax
import pytest

from flaxformer_lite.attention import entry, registry, scheme, select


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


def _options(__post_init__=None, **defaults):
  """A frozen options type whose fields are `defaults`, typed by them."""
  return dataclasses.make_dataclass(
      'FakeOptions', [(k, type(v), dataclasses.field(default=v)) for k, v in defaults.items()],
      frozen=True, namespace={'__post_init__': __post_init__} if __post_init__ else None)


def _fake(**defaults):
  return registry.AttentionVariant(name='fake', fn=lambda *a, **k: None,
                                   options=_options(**defaults))


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
  """kernel and chunk_size choose the kernel for every variant; none may
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


def test_what_fn_takes_is_read_from_its_signature_at_registration(scratch_registry):
  """CAPABILITIES: each keyword a fn names (q_offset, positions, rng,
  prev_alignment, implementation) sets its flag; one not named leaves it
  False; a flag given that the signature contradicts is refused, naming
  both."""
  def fn(query, key, value, *, q_offset=0, rng=None, **common):
    return query
  got = registry.register(registry.AttentionVariant(name='fake', fn=fn))
  assert (got.uses_positions, got.stochastic) == (True, True)
  assert not (got.position_arrays or got.uses_alignment or got.plain_product)
  with pytest.raises(ValueError, match="uses_alignment=True, but its fn does not take "
                                       "'prev_alignment'"):
    registry.register(registry.AttentionVariant(name='fake2', fn=fn, uses_alignment=True))


def test_scratch_registry_left_the_live_one_alone():
  assert 'fake' not in registry.names()


# ---- each variant's options: a frozen dataclass that validates itself ----------

_WITH_OPTIONS = [name for name in registry.names() if registry.get(name).options is not None]


def _wrong_values(kind):
  """Values an option of type `kind` must refuse: a sample of each other
  option type (an int passes for a float, as the checks allow)."""
  samples = (True, 7, 7.5, 'seven')
  return [v for v in samples if type(v) is not kind and not (kind is float and type(v) is int)]


def test_the_registry_has_variants_with_and_without_options():
  assert len(_WITH_OPTIONS) >= 10 and 'dot_product' not in _WITH_OPTIONS


@pytest.mark.parametrize('name', _WITH_OPTIONS)
def test_options_build_from_their_defaults_which_resolve_kwargs_returns(name):
  variant = registry.get(name)
  options = variant.options()
  defaults = {f.name: f.default for f in dataclasses.fields(variant.options)}
  assert registry.option_values(options) == defaults == dict(variant.kwargs)
  assert list(variant.kwargs) == list(defaults)  # the field order, as --list_attention shows
  assert registry.resolve_kwargs(name, None) == defaults
  assert registry.resolve_options(name, {}) == options
  hints = typing.get_type_hints(variant.options)
  assert all(type(v) is hints[k] for k, v in defaults.items()), hints
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(options, next(iter(defaults)), None)
  with pytest.raises(TypeError):
    variant.kwargs[next(iter(defaults))] = None  # pytype: disable=unsupported-operands


@pytest.mark.parametrize('name', _WITH_OPTIONS)
def test_options_refuse_a_value_of_another_type_naming_the_option(name):
  options = registry.get(name).options
  hints = typing.get_type_hints(options)
  for field in dataclasses.fields(options):
    for wrong in _wrong_values(hints[field.name]):
      shown = f'attention_kwargs.{field.name}={wrong!r}'
      with pytest.raises(ValueError, match=re.escape(shown)):
        options(**{field.name: wrong})
      with pytest.raises(ValueError, match=re.escape(shown)):
        registry.resolve_kwargs(name, {field.name: wrong})


def test_variants_without_options_resolve_to_none_and_no_kwargs():
  for name in sorted(set(registry.names()) - set(_WITH_OPTIONS)):
    assert dict(registry.get(name).kwargs) == {} and registry.resolve_kwargs(name, None) == {}
    assert registry.resolve_options(name, {'kernel': 'dense'}) is None


def _must_be_even(self):
  if self.fake_width % 2:
    raise ValueError(f'attention_kwargs.fake_width={self.fake_width}; must be even')


@pytest.mark.parametrize('options,match', [
    ({'fake_width': 2}, 'frozen dataclass'),
    (dataclasses.make_dataclass('Loose', [('fake_width', int, dataclasses.field(default=2))]),
     'frozen dataclass'),
    (dataclasses.make_dataclass('Mistyped', [('fake_width', int, dataclasses.field(default=2.0))],
                                frozen=True), "'fake_width' is annotated"),
    (dataclasses.make_dataclass('Unset', [('fake_width', int)], frozen=True),
     "'fake_width' has no default"),
    (dataclasses.make_dataclass('Listed', [('fake_sizes', list, dataclasses.field(
        default_factory=list))], frozen=True), "'fake_sizes' has no default"),
    (_options(fake_width=3, __post_init__=_must_be_even), 'fake_width=3; must be even'),
])
def test_register_refuses_options_that_are_not_typed_defaults_that_validate(
    scratch_registry, options, match):
  with pytest.raises(ValueError, match=match):
    registry.register(registry.AttentionVariant(name='fake', fn=lambda *a, **k: None,
                                                options=options))
  assert 'fake' not in registry.names()


@pytest.mark.parametrize('name', registry.names())
def test_every_option_of_another_variant_is_refused_naming_the_valid_ones(name):
  """Each option that only other variants take (every one of them, with its
  default) is an error naming it, the variant, and each option the variant
  does take (name=default, the kernel options included)."""
  variant = registry.get(name)
  others = registry.all_kwargs()
  foreign = sorted(set(others) - set(variant.kwargs) - set(registry.KERNEL_OPTIONS))
  assert foreign
  own = [f'{k}={v!r}' for k, v in {**variant.kwargs, **registry.KERNEL_OPTIONS}.items()]
  for option in foreign:
    with pytest.raises(ValueError, match=rf"\['{option}'\].*{name!r}") as e:
      registry.resolve_kwargs(name, {option: others[option]})
    assert all(o in str(e.value) for o in own), (option, str(e.value))


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
  """The name of the kernel 'auto' picks on CPU (select.py has every platform's)."""
  query = jax.ShapeDtypeStruct((b, n, h, 64), dtype)
  key = jax.ShapeDtypeStruct((b, m, g or h, 64), dtype)
  variant = registry.get(name)
  specs = variant.params(h, 64, dict(variant.kwargs)) if variant.params else {}
  with select.target_platform('cpu'):
    return entry.plan(query, key, scheme=name, options=options, dtype=dtype,
                      decoding=decoding, return_weights=return_weights,
                      positions=jax.numpy.arange(n) if positions else None,
                      params={p: jax.ShapeDtypeStruct(shape, 'float32')
                              for p, (shape, _, _) in specs.items()}).kernel.name


# The kernels 'auto' may take for the dense and the chunked kernel: a scheme's
# own in their place (select._written_for).
DENSE, CHUNKED = ('dense', 'shaw_banded', 'local_blocked'), ('chunked', 'shaw_by_lag')


@pytest.mark.parametrize('name', registry.chunked_names())
def test_auto_is_dense_up_to_96_mib_of_scores_on_cpu_then_chunked(name):
  """b * h * n * m scores of the compute dtype against the CPU's 96 MiB:
  8 heads of 512 x 512 float32 scores are 8 MiB a row, so 12 rows are at
  the threshold and 13 above it; bfloat16 halves the bytes; batch and heads
  count as much as length (b = 64, h = 16, n = 512: 1 GiB). An explicit
  dense_max_mib replaces the 96. Dense is the dense kernel or one written
  for the scheme in its place (select._written_for: shaw_banded,
  local_blocked), chunked the same (shaw_by_lag)."""
  assert _pick(name, 12, 512, 512) in DENSE
  assert _pick(name, 13, 512, 512) in CHUNKED
  assert _pick(name, 24, 512, 512, dtype='bfloat16') in DENSE
  assert _pick(name, 25, 512, 512, dtype='bfloat16') in CHUNKED
  assert _pick(name, 4, 768, 768) in DENSE  # 72 MiB
  assert _pick(name, 4, 1024, 1024) in CHUNKED  # 128 MiB
  assert _pick(name, 64, 512, 512, h=16) in CHUNKED
  assert _pick(name, 1, 4096, 4096, g=1) in CHUNKED  # the query heads count
  assert _pick(name, 8, 512, 512, dense_max_mib=64) in DENSE
  assert _pick(name, 9, 512, 512, dense_max_mib=64) in CHUNKED
  assert _pick(name, 1, 16, 16, dense_max_mib=0) in CHUNKED
  assert _pick(name, 64, 512, 512, return_weights=True) == 'dense'  # only dense has them
  assert _pick(name, 64, 512, 512, kernel='dense') == 'dense'
  assert _pick(name, 1, 16, 16, kernel='chunked') == 'chunked'


@pytest.mark.parametrize('name', registry.chunked_names())
def test_auto_decodes_a_cache_longer_than_two_blocks_on_the_chunked_kernel(name):
  """One query against a cache: the chunked kernel stops at the cache index
  (causal bounds), the dense one reads all of it. Blocks of 512 on CPU."""
  assert _pick(name, 4, 1, 2048, decoding=True) in CHUNKED
  assert _pick(name, 4, 1, 1024, decoding=True) in DENSE
  assert _pick(name, 4, 1, 1024, decoding=True, chunk_size=256) in CHUNKED
  assert _pick(name, 4, 1, 2048, decoding=False) in DENSE


@pytest.mark.parametrize('name', sorted(set(registry.chunked_names())
                                         & set(registry.position_array_names())))
def test_positions_given_as_data_run_on_the_dense_kernel(name):
  """Randomized positions: the chunked forms' block terms may read a block's
  positions as a range, so such a call is dense whatever its size or option."""
  assert _pick(name, 64, 512, 512, h=16) == 'chunked'
  assert _pick(name, 64, 512, 512, h=16, positions=True) == 'dense'
  assert _pick(name, 1, 16, 16, kernel='chunked', positions=True) == 'dense'


def test_auto_keeps_variants_without_a_chunked_form_dense():
  for name in sorted(set(registry.names()) - set(registry.chunked_names())):
    assert _pick(name, 64, 512, 512, h=16) == 'dense', name
    assert _pick(name, 4, 1, 4096, decoding=True) == 'dense', name


def test_dense_max_mib_is_checked():
  with pytest.raises(ValueError, match='dense_max_mib=-1'):
    registry.resolve_kernel('dot_product', {'dense_max_mib': -1})


def test_registry_holds_exactly_the_expected_variants():
  assert set(registry.names()) == {
      'dot_product', 'shaw', 't5_bias', 'alibi', 'rotary', 'local', 'bahdanau', 'luong_dot',
      'luong_general', 'luong_concat', 'luong_local_p', 'luong_local_m',
      'location_sensitive', 'hard', 'transformer_xl', 'deberta', 'kerple', 'sandwich', 'fire',
      'xpos', 'cope'}
  for name in registry.names():
    row = registry.describe(registry.get(name))
    assert row.name == name and row.models and row.kernels and row.options and row.doc


@pytest.mark.parametrize('name', [n for n in registry.names() if registry.get(n).terms])
def test_every_schemes_terms_keep_their_contract(name):
  """scheme.check_terms on every registered scheme (default options, 2 heads
  of 4, parameters from their initialisers): a values term linear in the
  weights, an additive score that adds one bias for every batch row."""
  variant = registry.get(name)
  kwargs = dict(variant.kwargs)
  specs = variant.params(2, 4, kwargs) if variant.params else {}
  scheme.check_terms(name, variant.terms(2, **kwargs), scheme.random_params(specs), 2, 4)


def test_the_kernel_options_old_name_is_refused_naming_the_new_one():
  with pytest.raises(ValueError, match="implementation='dense': the option is 'kernel' now; "
                                       "did you mean attention_kwargs.kernel='dense'"):
    registry.resolve_kwargs('alibi', {'implementation': 'dense'})
