"""Named attention variants: the one swap point (`config.model.attention`).

A variant is a pure function plus an entry here. `MultiHeadAttention` calls
  fn(query [b,n,h,d], key [b,m,h,d], value [b,m,h,d], *, mask, bias,
     dropout_rate, dropout_rng, deterministic, dtype, return_weights,
     **params, **kwargs)
  -> [b, n, h, d], or (that, weights [b, h, n, m]) when return_weights
where `params` are arrays the layer creates from `AttentionVariant.params`
(learned tables, per-head matrices) and `kwargs` are the fields of the
variant's options (`AttentionVariant.options`, a frozen dataclass that
validates itself), set from `config.model.attention_kwargs` (resolve_kwargs).
Some variants receive more, where `fn` names the keyword (its signature is
read once, at registration: CAPABILITIES):
  q_offset: the absolute position of the first query (non-zero when
    decoding with a cache, or for an RNN decoder's step t);
  positions: int [n], the positions of self-attention's queries and keys
    as data (randomized positions, Ruoss et al. 2023);
  rng: a PRNG key when deterministic=False, else None;
  prev_alignment: [b, h, n, m], the sum of the weights of all earlier
    decoder steps (zeros at the first); only a step-by-step decoder (the
    RNN) can supply it, so such variants list rnn_seq2seq only;
  implementation: 'xla' | 'cudnn' for jax.nn.dot_product_attention: the
    scheme is plain q.k after maps of q and k, so the kernels that run only
    that (cuDNN, XLA's, splash) take it (dot_product, rotary).

The kernel is chosen apart from the variant, by the options every variant
takes (KERNEL_OPTIONS): `kernel` ('auto' or a kernel of
kernels/table.py), `chunk_size` and `dense_max_mib`. A variant that can run
block by block has `chunked`, called as `fn` but with a masks.Mask (or None)
for `mask`, `chunk_size`, and without `deterministic` (dropout is on when
`dropout_rng` is given), bias or weights (kernels/blockwise.py); keys and values
may have fewer heads than the queries there (grouped-query attention).
select.choose (the `auto` policy, per platform) decides which kernel runs.
"""
from __future__ import annotations

import dataclasses
import inspect
import textwrap
import types
import typing
from typing import Any, Callable, Mapping, NamedTuple

from flaxformer_lite import model_types
from flaxformer_lite.attention import scheme, select
from flaxformer_lite.attention.kernels import blockwise
from flaxformer_lite.attention.kernels import table as kernels
from flaxformer_lite.attention.kernels.reference import dense_attention

TRANSFORMER_MODELS = model_types.TRANSFORMER_TYPES
ALL_MODELS = tuple(model_types.MODEL_TYPES)


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
  """One registry entry.

  name: the config value.
  fn: the pure attention function (signature above).
  options: the variant's options as a frozen dataclass type, or None where it
    has none: each field an option (its name, its type, one of OPTION_TYPES,
    the type the command line accepts, and its default), its docstring what
    they mean, its `__post_init__` raising ValueError
    'attention_kwargs.<name>=<value>; ...' naming what is valid (check_int,
    check_choice, check_bool, check_positive). `kwargs` reads its defaults.
  params: (num_heads, head_dim, kwargs) -> {name: (shape, initializer,
    logical axes)}; the layer creates these parameters and passes them to `fn`
    by name. The logical axes (one name or None per dimension: 'heads',
    'kv' = the head dimension, 'embed', 'relative' = rows indexed by
    distance or bucket) say how a model axis shards the table
    (train/partitioning.py LOGICAL_RULES).
  models: model types that can use the variant.
  check_head_dim: head size -> None, raising ValueError where the variant
    cannot run on heads of that size (rotary: pairs of features).
  doc: one line for `--list_attention`.
  chunked: the block-by-block form (module docstring), or None.
  grouped_kv: `fn` takes keys and values with g heads, g dividing the
    query heads h (query head i reads head i // (h / g)); without it the
    layer copies each key/value head to its group for `fn`. The chunked
    kernel always takes g heads.
  uses_positions, position_arrays, stochastic, uses_alignment,
    plain_product: what `fn` takes (module docstring), read from its
    signature at registration (CAPABILITIES); leave them unset (a value
    given must agree with the signature).
  terms: (num_heads, **kwargs) -> scheme.Terms, the variant written once
    as what it changes in the kernels' scaled q.k scores (its score, tables,
    query and key maps, values term: scheme.py): `register` derives `fn`
    and `chunked` from it where they are not given (`derived_fns`; a
    hand-written `fn` then is a faster or the paper's reference form of the
    same math). Its contracts (a linear values term, an additive score that
    adds) are checked for every registered scheme by
    tests/attention/test_registry.py (scheme.check_terms), not at lookup.
  """
  name: str
  fn: Callable[..., Any] | None = None
  options: type | None = None
  params: Callable[..., Mapping[str, Any]] | None = None
  models: tuple[str, ...] = ALL_MODELS
  check_head_dim: Callable[[int], None] | None = None
  uses_positions: bool | None = None
  stochastic: bool | None = None
  uses_alignment: bool | None = None
  doc: str = ''
  chunked: Callable[..., Any] | None = None
  plain_product: bool | None = None
  grouped_kv: bool = False
  terms: Callable[..., Any] | None = None
  position_arrays: bool | None = None

  @property
  def kwargs(self) -> Mapping[str, Any]:
    """Option name -> default, in the options' field order (read-only)."""
    if self.options is None:
      return types.MappingProxyType({})
    return types.MappingProxyType({f.name: f.default for f in dataclasses.fields(self.options)})


# The types an option may have: those a command-line flag (config.py's
# placeholders, typed by the defaults) can carry.
OPTION_TYPES = (bool, int, float, str)


_REGISTRY: dict[str, AttentionVariant] = {}

# The option names that several variants take, each with its one meaning. A
# value in `config.model.attention_kwargs` carries over when the user swaps the
# variant, so any other name belongs to one variant only (`register` checks).
SHARED_OPTIONS: dict[str, str] = {
    'half_window': "Luong's D: query i sees the keys |j - p_i| <= D around its "
                   'window position p_i',
    'max_wavelength': "RoPE's base b: feature pair i of d turns by b^(-2i/d) a position",
}

# Options of every variant, not of one: which kernel runs it. kernel:
# 'auto' (select.choose) or a kernel's name (kernels/table.py TABLE: 'dense',
# the [n, m] scores, the reference; 'chunked', blocks, O(n) memory; 'pallas',
# the fused Pallas kernel; 'cudnn', 'xla', 'splash'); chunk_size: rows and
# columns per block of the chunked kernel; dense_max_mib: 'auto' keeps the
# dense kernel while one call's scores (b * h * n * m in the compute dtype)
# take at most this many MiB. Unset (None), those two are the platform's
# (select.POLICIES).
KERNELS = ('auto', *kernels.TABLE)
KERNEL_OPTIONS = {'kernel': 'auto', 'chunk_size': None, 'dense_max_mib': None}
# The names kernel options had before, refused naming the new one.
# Options that are gone, with the one that says the same now and its value
# for each old one: kernels are chosen by `kernel` alone (Shaw's forms are
# kernels of the table).
RENAMED_OPTIONS = {'implementation': ('kernel', {}),
                   'form': ('kernel', {'banded': 'shaw_banded', 'naive': 'dense',
                                       'matmul': 'dense'})}


class KernelOptions(NamedTuple):
  """A variant's kernel options, checked (resolve_kernel); None = the platform's."""
  kernel: str
  chunk_size: int | None
  dense_max_mib: int | None


def _check_options(variant: AttentionVariant) -> None:
  """Raises unless each option of `variant` is new, or shared (SHARED_OPTIONS)
  with the same default as every variant that already takes it."""
  for name, default in variant.kwargs.items():
    for other in _REGISTRY.values():
      if name not in other.kwargs:
        continue
      theirs = other.kwargs[name]
      if name not in SHARED_OPTIONS:
        raise ValueError(
            f'attention option {name!r} of variant {variant.name!r} is already an option '
            f'of {other.name!r}: a value set for one would carry over to the other. Give '
            f'it a name of its own, or, if it means the same thing in both, declare it in '
            f'registry.SHARED_OPTIONS with that meaning and use the same default')
      if type(default) is not type(theirs) or default != theirs:
        raise ValueError(
            f'attention option {name!r} is shared (registry.SHARED_OPTIONS) but defaults '
            f'to {default!r} in {variant.name!r} and to {theirs!r} in {other.name!r}; a '
            'shared option has one default: use the same one, or a name of its own')


def _value(options, option: str) -> Any:
  """`option` of an options value (an attribute) or of a mapping of them."""
  return options[option] if isinstance(options, Mapping) else getattr(options, option)


def is_number(v: Any) -> bool:
  """Whether `v` is an int or a float, not a bool."""
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(options, option: str, low: int | None = None, why: str = '') -> None:
  """Raises ValueError unless `option` of `options` (an options value or a
  mapping) is an int (not a bool), >= low unless low is None; `why` (what the
  option is) ends the message."""
  v = _value(options, option)
  if isinstance(v, bool) or not isinstance(v, int) or (low is not None and v < low):
    raise ValueError(f'attention_kwargs.{option}={v!r}; must be an int'
                     + (f' >= {low}' if low is not None else '') + (f' ({why})' if why else ''))


def check_choice(options, option: str, choices, why: str = '') -> None:
  """Raises ValueError unless `option` of `options` is one of `choices`, naming them."""
  v = _value(options, option)
  if v not in choices:
    raise ValueError(f'attention_kwargs.{option}={v!r}; valid: '
                     f'{", ".join(choices)}' + (f' ({why})' if why else ''))


def check_bool(options, option: str) -> None:
  """Raises ValueError unless `option` of `options` is True or False."""
  v = _value(options, option)
  if not isinstance(v, bool):
    raise ValueError(f'attention_kwargs.{option}={v!r}; valid: True, False')


def check_positive(options, option: str) -> None:
  """Raises ValueError unless `option` of `options` is a number > 0."""
  v = _value(options, option)
  if not (is_number(v) and v > 0):
    raise ValueError(f'attention_kwargs.{option}={v!r}; must be a number > 0')


def option_values(options) -> dict[str, Any]:
  """An options value (or None: no options) as option name -> value."""
  if options is None:
    return {}
  return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def _check_options_type(variant: AttentionVariant) -> None:
  """Raises unless `variant.options` is None or a frozen dataclass type."""
  options = variant.options
  if options is not None and not (isinstance(options, type) and dataclasses.is_dataclass(options)
                                  and options.__dataclass_params__.frozen):
    raise ValueError(f'attention variant {variant.name!r}: options must be a frozen '
                     f'dataclass type, not {options!r}')


def _check_option_fields(variant: AttentionVariant) -> None:
  """Raises unless every field of `variant.options` has a default of its
  annotated type, one of OPTION_TYPES, and the defaults validate (building
  the options runs their `__post_init__`)."""
  options = variant.options
  if options is None:
    return
  hints = typing.get_type_hints(options)
  for field in dataclasses.fields(options):
    kind = hints.get(field.name)
    if field.default is dataclasses.MISSING:
      raise ValueError(f'attention variant {variant.name!r}: option {field.name!r} has no '
                       'default (the value an unset attention_kwargs entry takes)')
    if kind not in OPTION_TYPES or type(field.default) is not kind:
      raise ValueError(
          f'attention variant {variant.name!r}: option {field.name!r} is annotated '
          f'{kind!r} with default {field.default!r}; an option is one of '
          f'{", ".join(t.__name__ for t in OPTION_TYPES)} with a default of that type')
  options()  # the defaults must pass the options' own checks


def register(variant: AttentionVariant) -> AttentionVariant:
  if variant.name in _REGISTRY:
    raise ValueError(f'attention variant {variant.name!r} is registered twice')
  _check_options_type(variant)
  clash = sorted(set(variant.kwargs) & set(KERNEL_OPTIONS))
  if clash:
    raise ValueError(f'attention variant {variant.name!r} declares {clash}: those are the '
                     'kernel options every variant takes (KERNEL_OPTIONS)')
  _check_option_fields(variant)
  _check_options(variant)
  if variant.terms is not None:
    variant = _with_terms(variant)
  if variant.fn is None:
    raise ValueError(f'attention variant {variant.name!r} needs fn= or terms=')
  variant = _with_capabilities(variant)
  _REGISTRY[variant.name] = variant
  return variant


# What a variant can be given beyond q, k, v and its options: each is the
# keyword its `fn` names (module docstring).
CAPABILITIES = {'uses_positions': 'q_offset', 'position_arrays': 'positions',
                'stochastic': 'rng', 'uses_alignment': 'prev_alignment',
                'plain_product': 'implementation'}


def _with_capabilities(variant: AttentionVariant) -> AttentionVariant:
  """`variant` with CAPABILITIES read from its fn's signature, once; raises
  where a value given disagrees with it."""
  takes = inspect.signature(variant.fn).parameters
  derived = {field: keyword in takes for field, keyword in CAPABILITIES.items()}
  for field, value in derived.items():
    given = getattr(variant, field)
    if given is not None and bool(given) != value:
      raise ValueError(
          f'attention variant {variant.name!r}: {field}={given!r}, but its fn '
          f'{"takes" if value else "does not take"} {CAPABILITIES[field]!r}; the capability '
          f'is read from fn\'s signature: leave {field} unset')
  return dataclasses.replace(variant, **derived)


def _with_terms(variant: AttentionVariant) -> AttentionVariant:
  """`variant` with the kernels its `terms` give where it names none."""
  kwargs = dict(variant.kwargs)
  specs = variant.params(2, 4, kwargs) if variant.params else {}
  if set(specs) & set(kwargs):
    raise ValueError(f'attention variant {variant.name!r}: parameters '
                     f'{sorted(set(specs) & set(kwargs))} are named like its options')
  fn, chunked = derived_fns(variant.terms, variant.kwargs)
  return dataclasses.replace(variant, fn=variant.fn or fn, chunked=variant.chunked or chunked)


def derived_fns(make_terms: Callable[..., scheme.Terms], option_names) -> tuple:
  """(fn, chunked) from `make_terms(num_heads, **options)`: the dense
  reference and the blockwise kernel on its terms. Keyword arguments named in
  `option_names` are the scheme's options, the others (besides the kernels'
  own) its parameters."""
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
    return blockwise.dot_product(query, key, value, terms, params, mask=mask, q_offset=q_offset,
                                 chunk_size=chunk_size, dtype=dtype, dropout_rate=dropout_rate,
                                 dropout_rng=dropout_rng)

  return fn, chunked_fn


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(name: str) -> AttentionVariant:
  if name not in _REGISTRY:
    raise ValueError(f'unknown attention variant {name!r}; valid: {", ".join(names())}')
  return _REGISTRY[name]


def all_kwargs() -> dict[str, Any]:
  """Every option any variant accepts -> its default (one per name: `register`
  admits a name twice only when it is shared with the same default), the
  kernel options included; for chunk_size and dense_max_mib, whose default
  is the platform's, the CPU's (config.py types its placeholders by these)."""
  own = {k: default for v in _REGISTRY.values() for k, default in v.kwargs.items()}
  cpu = select.POLICIES['cpu']
  return {**own, 'kernel': KERNEL_OPTIONS['kernel'],
          'chunk_size': cpu.chunk_size, 'dense_max_mib': cpu.dense_max_mib}


def inline(score: Callable[..., Any]) -> AttentionVariant:
  """An unregistered variant for attend(score=...): the terms Terms(score=
  score) with its kernels derived, its tables given at the call; named after
  the function for messages."""
  name = f'score {getattr(score, "__name__", type(score).__name__)}'
  return _with_capabilities(_with_terms(AttentionVariant(
      name=name, terms=lambda num_heads: scheme.Terms(score=score), models=TRANSFORMER_MODELS)))


def _variant(name_or_variant: str | AttentionVariant) -> AttentionVariant:
  if isinstance(name_or_variant, AttentionVariant):
    return name_or_variant
  return get(name_or_variant)


def resolve_options(name: str | AttentionVariant, given: Mapping[str, Any] | None) -> Any | None:
  """The variant's options value (None where it has none): its defaults
  overridden by `given`, validated by building it.

  `given` may hold None for options left unset (the config declares every
  option of every variant as an unset placeholder), and the kernel options
  (KERNEL_OPTIONS: checked here, resolved by resolve_kernel). An option set
  for a variant that does not take it is an error naming the variant's
  options.
  """
  variant = _variant(name)
  given = {k: v for k, v in dict(given or {}).items() if v is not None}
  for old, (new, values) in RENAMED_OPTIONS.items():
    if old in given:
      value = values.get(given[old], given[old])
      raise ValueError(f'attention_kwargs.{old}={given[old]!r}: the option is {new!r} now; '
                       f'did you mean attention_kwargs.{new}={value!r}?')
  unknown = sorted(set(given) - set(variant.kwargs) - set(KERNEL_OPTIONS))
  if unknown:
    valid = ', '.join(f'{k}={v!r}' for k, v in {**variant.kwargs, **KERNEL_OPTIONS}.items())
    raise ValueError(f'attention_kwargs {unknown} do not apply to attention='
                     f'{variant.name!r}; its options are: {valid}')
  resolve_kernel(variant, given)
  if variant.options is None:
    return None
  return variant.options(**{k: v for k, v in given.items() if k not in KERNEL_OPTIONS})


def resolve_kwargs(name: str | AttentionVariant,
                   given: Mapping[str, Any] | None) -> dict[str, Any]:
  """resolve_options as option name -> value: the keyword arguments of the
  variant's `fn`, `terms` and `params`."""
  return option_values(resolve_options(name, given))


def resolve_kernel(name: str | AttentionVariant,
                   given: Mapping[str, Any] | None) -> KernelOptions:
  """The kernel options from `given` (attention_kwargs; None = unset), checked."""
  variant = _variant(name)
  given = {k: v for k, v in dict(given or {}).items() if v is not None}
  kernel = KernelOptions(**{k: given.get(k, default) for k, default in KERNEL_OPTIONS.items()})
  _validate_kernel(variant, kernel)
  return kernel


def runs_on(name: str, kernel: str) -> bool:
  """Whether the kernel named `kernel` ('auto', or one of kernels.TABLE) can
  run the scheme `name` at all."""
  return kernel == 'auto' or kernels.TABLE[kernel].takes(_variant(name)) is None


def position_array_names() -> list[str]:
  """The variants that read positions and take them as arrays
  (randomized positions)."""
  return [name for name in names()
          if _REGISTRY[name].uses_positions and _REGISTRY[name].position_arrays]


def chunked_names() -> list[str]:
  return [name for name in names() if _REGISTRY[name].chunked is not None]


def _validate_kernel(variant: AttentionVariant, kernel: KernelOptions) -> None:
  impl = kernel.kernel
  if impl not in KERNELS:
    raise ValueError(f'attention_kwargs.kernel={impl!r}; valid: '
                     f'{", ".join(map(repr, KERNELS))}')
  if impl != 'auto':
    reason = kernels.TABLE[impl].takes(variant)
    if reason is not None:
      runs = ', '.join(n for n in names() if kernels.TABLE[impl].takes(_REGISTRY[n]) is None)
      raise ValueError(f'attention_kwargs.kernel={impl!r}: attention={variant.name!r} '
                       f'does not run on it ({reason}); schemes it runs: {runs}')
  if impl == 'cudnn' and select.platform() != 'gpu':
    raise ValueError(
        "attention_kwargs.kernel='cudnn' needs an NVIDIA GPU, and this machine's "
        f"JAX backend is {select.platform()!r}; use 'auto' (picks cuDNN where it can "
        "run) or 'dense'/'xla'/'chunked'")
  for option, low in (('chunk_size', 1), ('dense_max_mib', 0)):
    if getattr(kernel, option) is not None:
      check_int(kernel, option, low)


def pallas_runs(variant: AttentionVariant) -> bool:
  """Whether the fused Pallas kernel runs `variant`."""
  return kernels.PALLAS.takes(variant) is None


class Description(NamedTuple):
  """A variant's row in `table`: one entry a line in each list column."""
  name: str
  models: tuple[str, ...]  # 'all' and 'transformers' stand for those sets
  kernels: tuple[str, ...]  # values of attention_kwargs.kernel besides 'auto'
  options: tuple[str, ...]  # its own options, 'name=default'
  doc: str


def describe(variant: AttentionVariant) -> Description:
  """`variant`'s row in `table`."""
  if variant.models == ALL_MODELS:
    models = ('all',)
  elif variant.models == TRANSFORMER_MODELS:
    models = ('transformers',)
  else:
    models = variant.models
  runs = tuple(name for name, kernel in kernels.TABLE.items() if kernel.takes(variant) is None)
  return Description(variant.name, models, runs,
                     tuple(f'{k}={v!r}' for k, v in variant.kwargs.items()) or ('-',),
                     variant.doc)


def refusals(width: int = 100) -> str:
  """The scheme x kernel table's refusals: per kernel, the schemes it does
  not run, grouped by the reason (Kernel.takes), wrapped to `width`."""
  lines = textwrap.wrap('Kernels (attention_kwargs.kernel) and the schemes they do '
                        'not run:', width)
  for name, kernel in kernels.TABLE.items():
    by_reason = {}
    for scheme_name in names():
      reason = kernel.takes(_REGISTRY[scheme_name])
      if reason is not None:
        by_reason.setdefault(reason, []).append(scheme_name)
    runs = [n for n in names() if kernel.takes(_REGISTRY[n]) is None]
    if not by_reason:
      told = 'runs every scheme'
    elif len(runs) == 1:  # written for one scheme
      told = f'runs {runs[0]} alone'
    else:
      told = '; '.join(f'not {", ".join(refused)}: {reason}'
                       for reason, refused in by_reason.items())
    text = f'{name}: {kernel.doc}; {told}'
    lines += textwrap.wrap(text, width, initial_indent='  ', subsequent_indent='    ')
  return '\n'.join(lines)


_HEADER = Description('name', ('models',), ('kernels',), ('options',), 'description')
_GAP, _INDENT = '  ', '    '


def table(width: int = 100) -> str:
  """Every variant (`describe`) as a table with a header, then what all
  variants share. Name, models, kernels and options are aligned columns, the
  kernels and each option wrapped in theirs; the description follows on lines
  of its own, indented, wrapped to `width`. No line is longer than `width`
  unless `width` leaves the options fewer than 12 characters. A listing reads
  what registration declared."""
  rows = [describe(_REGISTRY[name]) for name in names()]
  kernels = [textwrap.wrap(' '.join(r.kernels), len('dense chunked')) for r in [_HEADER, *rows]]
  widths = [max(len(r.name) for r in [_HEADER, *rows]),
            max(len(m) for r in [_HEADER, *rows] for m in r.models),
            max(len(k) for lines in kernels for k in lines)]
  options_width = min(max(len(o) for r in [_HEADER, *rows] for o in r.options),
                      max(12, width - sum(widths) - 3 * len(_GAP)))
  widths.append(options_width)

  def render(row: Description, kernel_lines: list[str]) -> list[str]:
    cells = [[row.name], list(row.models), kernel_lines,
             [part for option in row.options for part in textwrap.wrap(option, options_width)]]
    columns = [_GAP.join((cell[i] if i < len(cell) else '').ljust(w)
                         for cell, w in zip(cells, widths)).rstrip()
               for i in range(max(map(len, cells)))]
    return columns + textwrap.wrap(row.doc, width, initial_indent=_INDENT,
                                   subsequent_indent=_INDENT, break_on_hyphens=False)

  kernel_options = ', '.join(f'{k}=' + ("the platform's" if v is None else repr(v))
                             for k, v in KERNEL_OPTIONS.items())
  footer = (f'models: all = {", ".join(ALL_MODELS)}; transformers = '
            f'{", ".join(TRANSFORMER_MODELS)}. Every variant also takes the kernel options '
            f'{kernel_options} (attention_kwargs; kernel: auto or one of its '
            'kernels).')
  lines = render(_HEADER, kernels[0]) + [_GAP.join('-' * w for w in widths)]
  for row, kernel_lines in zip(rows, kernels[1:]):
    lines += render(row, kernel_lines)
  return '\n'.join([*lines, '', *textwrap.wrap(footer, width), '', refusals(width), '',
                    select.table(width)])
