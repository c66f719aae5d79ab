"""The `auto` kernel policy (attention/select.py): the choice per platform as a
function of shapes and dtypes, then the path a layer lowered for CUDA on this
machine takes, read from its HLO."""
import importlib
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from flaxformer_lite.attention import entry, masks, registry, select
from flaxformer_lite.attention.kernels import blockwise, pallas_gpu
from flaxformer_lite.attention.kernels import table as kernels
from flaxformer_lite.attention.schemes import rotary as rotary_lib
from flaxformer_lite.layers import MultiHeadAttention

MIB = 2**20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def device_memory(monkeypatch):
  """device_memory(bytes or None): the memory select reads from the device
  (None: none reported, the platform's fixed fallback). None until set, so
  that a test's thresholds do not depend on the machine running it."""
  def set_memory(limit):
    monkeypatch.setattr(select, 'device_memory', lambda name: limit)
  set_memory(None)
  return set_memory


# The masks whose select.mask_kind is each kind (None: one splash cannot read).
MASK_OF_KIND = {'causal': masks.causal(), 'full': None, None: masks.prefix_lm(jnp.zeros(1, int))}


def _call(platform, name='dot_product', b=2, n=128, m=None, h=8, g=None, d=64,
          dtype='bfloat16', decoding=False, dropout=False, mask_kind=None,
          return_weights=False, **options):
  """entry.describe_call of attend's call on ShapeDtypeStructs, for `platform`."""
  query = jax.ShapeDtypeStruct((b, n, h, d), dtype)
  key = jax.ShapeDtypeStruct((b, n if m is None else m, g or h, d), dtype)
  with select.target_platform(platform):
    return entry.describe_call(
        query, key, scheme=name, mask=MASK_OF_KIND[mask_kind], options=options,
        params=_params(name, h, d), dtype=dtype, decoding=decoding,
        dropout_rate=0.1 if dropout else 0.0,
        dropout_rng=jax.random.key(0) if dropout else None, return_weights=return_weights)


def _params(name, h, d):
  variant = registry.get(name)
  specs = variant.params(h, d, dict(variant.kwargs)) if variant.params else {}
  return {p: jax.ShapeDtypeStruct(shape, 'float32') for p, (shape, _, _) in specs.items()}


def _pick(platform, name, b, n, m, h=8, g=None, d=64, dtype='float32', **kwargs):
  """The name of the kernel 'auto' (or options' kernel) runs."""
  call, requested, dense_max_mib = _call(platform, name, b, n, m, h, g, d, dtype, **kwargs)
  with select.target_platform(platform):
    return select.choose(call, requested, dense_max_mib).kernel.name


def _fits(platform, n=128, m=None, d=64, dtype='bfloat16', g=8, **kwargs):
  call, _, _ = _call(platform, n=n, m=m, d=d, dtype=dtype, g=g, **kwargs)
  return kernels.cudnn_fits(call) is None


def test_cudnn_fits_on_gpu_in_16_bits_within_its_shape_rules():
  assert _fits('gpu') and _fits('gpu', dtype='float16')
  assert _fits('gpu', g=2) and _fits('gpu', g=1)  # grouped-query, multi-query
  assert _fits('gpu', d=128) and _fits('gpu', d=8)
  assert not _fits('cpu') and not _fits('tpu')
  assert not _fits('gpu', dtype='float32')
  assert not _fits('gpu', d=12) and not _fits('gpu', d=256)
  assert not _fits('gpu', dropout=True) and not _fits('gpu', return_weights=True)
  assert not _fits('gpu', n=1, m=64)  # a decoding step
  assert not _fits('gpu', n=127) and not _fits('gpu', m=127)


def test_gpu_takes_cudnn_then_dense_while_an_eighth_of_memory_then_blocks_of_1024(
    device_memory):
  """16 heads of 2048 x 2048 float32 scores are 256 MiB a row. Without a
  reported limit, 2048 MiB: 8 rows dense, 9 chunked; with 80 GiB, 10 GiB:
  40 rows dense, 41 chunked. dot_product in bfloat16 is cuDNN's (dense)
  whatever its size, alibi the fused Pallas kernel's; in float32 alibi
  takes the size rule."""
  assert _pick('gpu', 'dot_product', 8, 2048, 2048, h=16) == 'dense'
  assert _pick('gpu', 'dot_product', 9, 2048, 2048, h=16) == 'chunked'
  assert _pick('gpu', 'dot_product', 64, 2048, 2048, h=16, dtype='bfloat16') == 'cudnn'
  assert _pick('gpu', 'alibi', 64, 2048, 2048, h=16, dtype='bfloat16') == 'pallas'
  assert _pick('gpu', 'alibi', 8, 2048, 2048, h=16) == 'dense'
  assert _pick('gpu', 'alibi', 9, 2048, 2048, h=16) == 'chunked'
  assert _pick('gpu', 'dot_product', 64, 2048, 2048, h=16, dtype='bfloat16',
               dropout=True) == 'chunked'  # no cuDNN with dropout: the size rule
  device_memory(80 * 2**30)
  assert _pick('gpu', 'dot_product', 40, 2048, 2048, h=16) == 'dense'
  assert _pick('gpu', 'dot_product', 41, 2048, 2048, h=16) == 'chunked'
  assert _pick('gpu', 'dot_product', 41, 2048, 2048, h=16, dense_max_mib=16384) == 'dense'
  with select.target_platform('gpu'):
    assert select.chunk_size() == 1024 and select.chunk_size(256) == 256
    assert select.dense_max_bytes() == 10 * 2**30
    assert select.dense_max_bytes(16) == 16 * MIB


def test_gpu_runs_a_per_pair_bias_table_chunked_past_one_block_of_pairs(device_memory):
  """t5_bias looks its bias up per query-key pair from a learned table: in
  float32 (no fused kernel) chunked on GPU past 1024 x 1024 pairs a head,
  whatever the memory share; alibi (a formula) and the other platforms keep the size rule; an explicit
  dense_max_mib overrides it."""
  assert _pick('gpu', 't5_bias', 4, 1024, 1024) == 'dense'
  assert _pick('gpu', 't5_bias', 1, 1024, 1025) == 'chunked'
  assert _pick('gpu', 't5_bias', 1, 8192, 8192, dense_max_mib=8192) == 'dense'
  assert _pick('gpu', 'alibi', 1, 8192, 8192, h=4) == 'dense'
  assert _pick('tpu', 't5_bias', 1, 8192, 8192, dtype='bfloat16') == 'dense'
  assert [name for name in registry.names()
          if select._pair_table(registry.get(name), 8, 64)] == ['t5_bias']


def test_gpu_decodes_on_the_chunked_kernel_past_two_blocks_of_1024(device_memory):
  assert _pick('gpu', 'dot_product', 4, 1, 2048, decoding=True, dtype='bfloat16') == 'dense'
  assert _pick('gpu', 'dot_product', 4, 1, 2049, decoding=True, dtype='bfloat16') == 'chunked'
  assert _pick('gpu', 'alibi', 4, 1, 1025, decoding=True, chunk_size=512) == 'chunked'


def test_tpu_is_dense_while_an_eighth_of_memory_then_blocks_of_512(device_memory):
  assert _pick('tpu', 'dot_product', 64, 2048, 2048, h=16, dtype='bfloat16') == 'chunked'
  assert _pick('tpu', 'dot_product', 16, 2048, 2048, h=16, dtype='bfloat16') == 'dense'
  device_memory(16 * 2**30)
  assert _pick('tpu', 'dot_product', 8, 2048, 2048, h=16) == 'dense'
  assert _pick('tpu', 'dot_product', 9, 2048, 2048, h=16) == 'chunked'
  with select.target_platform('tpu'):
    assert select.chunk_size() == 512


def test_tpu_keeps_splash_at_any_size_where_it_fits(device_memory):
  """Splash holds no [n, m] scores: dot_product and rotary whose mask it
  reads stay on splash past the memory share; alibi, an
  unreadable mask or dropout keep the size rule."""
  big = dict(b=64, n=2048, m=2048, h=16, d=128, dtype='bfloat16')
  assert _pick('tpu', 'dot_product', **big, mask_kind='causal') == 'splash'
  assert _pick('tpu', 'rotary', **big, mask_kind='full') == 'splash'
  assert _pick('tpu', 'dot_product', **big) == 'chunked'
  assert _pick('tpu', 'dot_product', **big, mask_kind='causal', dropout=True) == 'chunked'
  assert _pick('tpu', 'alibi', **big, mask_kind='causal') == 'chunked'
  assert _pick('gpu', 'dot_product', **big, mask_kind='causal') == 'cudnn'


def test_cpu_is_dense_up_to_96_mib_of_scores_whatever_the_machine(device_memory):
  """A causal LM at b=4, 8 heads, float32: n=768 (72 MiB) dense, n=1024
  (128 MiB) chunked; the device's memory plays no part on CPU."""
  device_memory(2**40)
  assert _pick('cpu', 'dot_product', 4, 512, 512) == 'dense'
  assert _pick('cpu', 'dot_product', 4, 768, 768) == 'dense'
  assert _pick('cpu', 'dot_product', 4, 1024, 1024) == 'chunked'
  assert _pick('cpu', 'dot_product', 8, 768, 768, dtype='bfloat16') == 'dense'
  assert _pick('cpu', 'alibi', 8, 768, 768, dtype='bfloat16', dense_max_mib=16) == 'chunked'
  with select.target_platform('cpu'):
    assert select.chunk_size() == 512 and select.dense_max_bytes() == 96 * MIB


def test_a_platform_without_a_policy_of_its_own_takes_the_tpu_rule():
  assert select.policy('METAL') == select.POLICIES['tpu']
  with pytest.raises(ValueError, match="'cuda'.*gpu, tpu, cpu"):
    with select.target_platform('cuda'):
      pass


def test_the_listing_says_each_platforms_thresholds():
  text = ' '.join(select.table(72).split())
  assert '1/8 of device memory (2048 MiB where it reports none)' in text
  assert ('cpu: dense while scores (b*h*n*m*itemsize) <= 96 MiB, else chunked in blocks '
          'of 512') in text
  assert 'chunked in blocks of 1024' in select.describe('gpu')
  assert 'cuDNN' in select.describe('gpu') and 'cuDNN' not in select.describe('tpu')
  assert 'on Pallas splash for a causal or full mask' in ' '.join(select.describe('tpu').split())
  assert 'splash' not in select.describe('gpu') + select.describe('cpu')
  assert ' '.join(registry.table(72).split()).endswith(text)


# ---- lowered for CUDA on this machine: the path in the HLO ----------------------

@pytest.fixture
def cudnn_lowerable(monkeypatch):
  """jax's cuDNN attention asks the installed cuDNN for its version while
  tracing (check_cudnn_version), and a CPU-only jaxlib has none ('cuDNN is
  not detected'): report 9.8, so that its custom call lowers for CUDA
  (never runs). A private module of jax: update the path if it moves."""
  fused = pytest.importorskip('jax._src.cudnn.fused_attention_stablehlo')
  monkeypatch.setattr(fused, 'check_cudnn_version', lambda: 90800)


@pytest.fixture
def chunk_sizes(monkeypatch):
  """The chunk_size of each blockwise.attend call traced while the test runs."""
  calls, attend = [], blockwise.attend

  def recorded(*args, chunk_size=None, **kwargs):
    calls.append(chunk_size)
    return attend(*args, chunk_size=chunk_size, **kwargs)
  monkeypatch.setattr(blockwise, 'attend', recorded)
  return calls


def _cuda_hlo(attention='dot_product', n=16, dtype=jnp.bfloat16, num_kv_heads=None,
              grad=False, head_dim=16, **options):
  """StableHLO of a causal MultiHeadAttention (2 heads of head_dim, batch 2)
  at length n, its forward or (grad) the gradient of its sum by its
  parameters, lowered for CUDA as a GPU would choose."""
  layer = MultiHeadAttention(num_heads=2, num_kv_heads=num_kv_heads, qkv_features=2 * head_dim,
                             attention=attention, attention_kwargs=options or None,
                             dtype=dtype)
  x = jax.ShapeDtypeStruct((2, n, 32), jnp.float32)
  params = jax.eval_shape(layer.init, jax.random.key(0), x)

  def forward(params, x):
    return layer.apply(params, x, mask=masks.causal()).astype(jnp.float32).sum()
  with select.target_platform('gpu'):
    traced = jax.jit(jax.grad(forward) if grad else forward).trace(params, x)
    return traced.lower(lowering_platforms=('cuda',)).as_text()


def test_dot_product_in_bf16_lowers_to_cudnn_for_a_gpu(cudnn_lowerable, device_memory):
  forward = _cuda_hlo()
  assert '__cudnn$fmha' in forward and 'stablehlo.while' not in forward
  assert '__cudnn$fmha' in _cuda_hlo(num_kv_heads=1)  # multi-query: its g heads in place
  assert '__cudnn$fmhaScaleBiasSoftmaxBackward' in _cuda_hlo(grad=True)
  assert '__cudnn$fmha' not in _cuda_hlo(dtype=jnp.float32)
  assert '__cudnn$fmha' not in _cuda_hlo(kernel='dense')


def test_rotary_rotates_q_and_k_then_lowers_to_cudnn_for_a_gpu(cudnn_lowerable, device_memory):
  """rotary only transforms q and k: its rotated q and k go to cuDNN's
  kernel (grouped-query too), and its output is dot_product's over the
  rotated q and k (checked on CPU, on the dense path)."""
  assert '__cudnn$fmha' in _cuda_hlo('rotary') and '__cudnn$fmha' in _cuda_hlo(
      'rotary', num_kv_heads=1)
  assert '__cudnn$fmha' not in _cuda_hlo('rotary', dtype=jnp.float32)
  rotary = registry.get('rotary')
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 2, 16)) for i in range(3))
  q_rot, k_rot = (rotary_lib.apply_rotary(x, jnp.arange(8)) for x in (q, k))
  expected = registry.get('dot_product').fn(q_rot, k_rot, v, implementation='dense')
  got = rotary.fn(q, k, v)
  assert jnp.allclose(got, expected, atol=1e-6)


def test_alibi_lowers_dense_for_a_gpu_then_chunked_in_blocks_of_1024_past_its_share(
    cudnn_lowerable, device_memory, chunk_sizes):
  """A 1 MiB device: 128 KiB of scores dense. At n = 64, 2 x 2 heads of
  bfloat16 scores are 32 KiB (dense, no loop); at n = 256, 256 KiB: the
  chunked kernel's loops, in the GPU's blocks unless chunk_size is set."""
  device_memory(MIB)
  dense = _cuda_hlo('alibi', n=64)
  assert '__cudnn$fmha' not in dense and 'stablehlo.while' not in dense
  assert chunk_sizes == []
  blocks = _cuda_hlo('alibi', n=256)
  assert '__cudnn$fmha' not in blocks and 'stablehlo.while' in blocks
  assert 'stablehlo.while' in _cuda_hlo('alibi', n=256, chunk_size=64)
  assert chunk_sizes == [1024, 64]


def test_the_gpu_runs_every_scheme_the_pallas_kernel_takes_on_it_in_16_bits(device_memory):
  """Over the live registry: a scheme whose terms are an elementwise score,
  lookups and q/k maps (registry.pallas_runs) takes the fused Pallas kernel on a GPU
  in bf16/fp16 with head dim 64 or 128, at any size, where dot_product keeps
  cuDNN; not in float32, not for a decoding step, not with dropout, not on
  the other platforms; schemes with terms it cannot run keep the others."""
  fused = [n for n in registry.names() if registry.pallas_runs(registry.get(n))]
  assert {'alibi', 'kerple', 'fire', 'sandwich', 't5_bias', 'rotary', 'xpos', 'shaw',
          'deberta', 'local'} <= set(fused)
  assert not {'transformer_xl', 'bahdanau'} & set(fused)
  for name in fused:
    if name in ('dot_product', 'rotary'):  # cuDNN's where it fits
      assert _pick('gpu', name, 64, 2048, 2048, dtype='bfloat16') == 'cudnn', name
      continue
    for dtype, d in (('bfloat16', 64), ('float16', 128)):
      assert _pick('gpu', name, 64, 8192, 8192, d=d, dtype=dtype) == 'pallas', name
    assert _pick('gpu', name, 2, 256, 256, dtype='float32') in (
        'dense', 'shaw_banded', 'local_blocked'), name
    assert _pick('gpu', name, 2, 256, 256, d=32, dtype='bfloat16') != 'pallas', name
    assert _pick('gpu', name, 2, 1, 256, dtype='bfloat16', decoding=True) != 'pallas', name
    assert _pick('gpu', name, 2, 256, 256, dtype='bfloat16', dropout=True) != 'pallas', name
    assert _pick('tpu', name, 2, 256, 256, dtype='bfloat16') != 'pallas', name
    assert _pick('cpu', name, 2, 256, 256, dtype='bfloat16') != 'pallas', name
  assert _pick('gpu', 'transformer_xl', 64, 2048, 2048, dtype='bfloat16') == 'chunked'
  assert _pick('cpu', 'alibi', 2, 16, 16, kernel='pallas') == 'pallas'
  with pytest.raises(ValueError, match="'pallas': attention='transformer_xl' does not run on "
                     "it .it has a term the fused kernel does not run: one that reads the "
                     "block's q and k with no lookup per query or key .Transformer-XL"):
    registry.resolve_kernel('transformer_xl', {'kernel': 'pallas'})


def test_a_scored_layer_lowers_to_the_pallas_kernel_for_a_gpu(device_memory):
  """MultiHeadAttention in bf16, heads of 64, under a causal mask with key
  padding, for every scheme the fused kernel runs but the two cuDNN takes
  (over the live registry): lowered for CUDA as a GPU chooses, the forward
  is one Triton call and no [n, m] array; the gradient three (forward,
  dk/dv, dq) for the lookup and table schemes and local's window; transformer_xl's
  stays off it."""
  def hlo(attention, grad):
    layer = MultiHeadAttention(num_heads=2, qkv_features=128, attention=attention,
                               dtype=jnp.bfloat16)
    x = jax.ShapeDtypeStruct((2, 256, 128), jnp.float32)
    params = jax.eval_shape(layer.init, jax.random.key(0), x)
    valid = jnp.ones((2, 256), bool).at[1, 200:].set(False)

    def forward(params, x):
      mask = masks.causal() & masks.key_padding(valid)
      return layer.apply(params, x, mask=mask).astype(jnp.float32).sum()
    with select.target_platform('gpu'):
      traced = jax.jit(jax.grad(forward) if grad else forward).trace(params, x)
      return traced.lower(lowering_platforms=('cuda',)).as_text()

  call = 'custom_call @__gpu$xla.gpu.triton'
  fused = [n for n in registry.names() if registry.pallas_runs(registry.get(n))
           and n not in ('dot_product', 'rotary')]
  assert {'alibi', 't5_bias', 'shaw', 'deberta', 'local'} <= set(fused)
  for name in fused:
    forward = hlo(name, grad=False)
    assert forward.count(call) == 1 and '256x256' not in forward, name
  for name in ('t5_bias', 'shaw', 'deberta', 'local'):
    backward = hlo(name, grad=True)
    assert backward.count(call) == 3 and '256x256' not in backward, f'{name}: an [n, m] array'
  assert call not in hlo('transformer_xl', grad=False)


def _tiles_file(tmp_path, monkeypatch, rows):
  """select reads `rows` as its table of tiles (a fresh path: nothing cached)."""
  path = tmp_path / f'tiles{len(list(tmp_path.iterdir()))}.json'
  path.write_text(json.dumps({'device': 'test', 'tiles': rows}))
  monkeypatch.setattr(select, 'PALLAS_TILES_FILE', str(path))


def _row(head_dim, max_length, *tiles):
  return dict(zip(select.TILE_FIELDS, (head_dim, max_length, *tiles)))


def test_the_fused_kernels_tiles_on_a_gpu_come_from_the_measured_table(tmp_path, monkeypatch):
  """A head dim's row with the least max_length at or above the call's
  longer length, its longest past them all; none for a head dim it lacks,
  none off a GPU (interpreted: the defaults), none without a file."""
  _tiles_file(tmp_path, monkeypatch, [_row(64, 8192, 128, 64, 8, 3), _row(64, 2048, 64, 64, 4, 2),
                                      _row(128, 2048, 64, 32, 4, 3)])
  with select.target_platform('gpu'):
    assert select.pallas_tiles(64, 1000) == (64, 64, 4, 2)
    assert select.pallas_tiles(64, 2049) == (128, 64, 8, 3)
    assert select.pallas_tiles(64, 100_000) == (128, 64, 8, 3)
    assert select.pallas_tiles(128, 4096) == (64, 32, 4, 3)
    assert select.pallas_tiles(32, 1000) is None
    shaw = registry.get('shaw').terms(2, **registry.resolve_kwargs('shaw', {}))
    assert select.pallas_tiles(64, 1000, shaw) is None  # lookups: not the plain kernel's tiles
    monkeypatch.setattr(select, 'PALLAS_TILES_FILE', str(tmp_path / 'none.json'))
    assert select.pallas_tiles(64, 1000) is None
  _tiles_file(tmp_path, monkeypatch, [_row(64, 2048, 64, 64, 4, 2)])
  with select.target_platform('cpu'):
    assert select.pallas_tiles(64, 1000) is None
  for bad in ([_row(64, 2048, 96, 64, 4, 2)], [_row(64, 2048, 64, 64, 4)],
              [_row(64, 0, 64, 64, 4, 2)]):
    _tiles_file(tmp_path, monkeypatch, bad)
    with select.target_platform('gpu'), pytest.raises(ValueError, match='is not a table of tiles'):
      select.pallas_tiles(64, 1000)


def _triton_calls(text):
  """(grid_z, num_warps, num_stages) of each Triton call in lowered text."""
  return [tuple(int(re.search(rf'{field} = (\d+)', call).group(1))
                for field in ('grid_z', 'num_warps', 'num_stages'))
          for call in text.split('custom_call @__gpu$xla.gpu.triton')[1:]]


def test_attend_gives_the_fused_kernel_the_tiles_of_the_table(tmp_path, monkeypatch):
  """Lowered for CUDA through the layer: the Triton calls (forward, dk/dv,
  dq) run the table's blocks (grid_z: 256 queries or keys in blocks of
  128 or 32), warps and stages; without a row, the kernel's defaults."""
  default = pallas_gpu.Tiles()
  _tiles_file(tmp_path, monkeypatch, [_row(32, 4096, 128, 32, 8, 3)])
  for head_dim, want in ((32, [(2, 8, 3), (8, 8, 3), (2, 8, 3)]),
                         (16, [(256 // default.block_q, default.num_warps, default.num_stages),
                               (256 // default.block_k, default.num_warps, default.num_stages),
                               (256 // default.block_q, default.num_warps, default.num_stages)])):
    text = _cuda_hlo('alibi', n=256, grad=True, kernel='pallas', head_dim=head_dim)
    assert _triton_calls(text) == want, head_dim


def test_the_tiles_benchmark_writes_the_table_select_reads(tmp_path, monkeypatch):
  """benchmarks/pallas_tiles.py (interpreted, two candidates): the fastest
  candidate's row, which select then gives the kernel; off a GPU it refuses
  to write the package's table (exit 2)."""
  script = os.path.join(REPO, 'benchmarks', 'pallas_tiles.py')
  out = tmp_path / 'tiles.json'
  run = subprocess.run([sys.executable, script, '--quick', '--repeats', '2', '--out', str(out)],
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  row, = json.loads(out.read_text())['tiles']
  assert (row['head_dim'], row['max_length']) == (16, 64) and row['ms'] <= row['default_ms']
  assert f"fastest q{row['block_q']}k{row['block_k']}" in run.stdout
  monkeypatch.setattr(select, 'PALLAS_TILES_FILE', str(out))
  with select.target_platform('gpu'):
    assert select.pallas_tiles(16, 64) == tuple(row[f] for f in pallas_gpu.Tiles._fields)
  refused = subprocess.run([sys.executable, script, '--quick'], capture_output=True, text=True,
                           timeout=300)
  assert refused.returncode == 2 and 'give --out' in refused.stderr


def test_the_tiles_table_keeps_the_cases_measured_before_a_run_is_stopped_or_by_another(tmp_path, monkeypatch):
  """pallas_tiles.py rewrites its table after every case: stopped during its
  second case (here: that case's measure raises), the file holds the first
  case's row, and a later command on the same device and jax adds its own
  (on another device, it starts the table anew)."""
  monkeypatch.syspath_prepend(os.path.join(REPO, 'benchmarks'))
  pallas_tiles = importlib.import_module('pallas_tiles')
  measured, real = [], pallas_tiles.measure

  def measure(*args, **kwargs):
    if measured:
      raise RuntimeError('stopped')
    measured.append(real(*args, **kwargs))
    return measured[-1]
  monkeypatch.setattr(pallas_tiles, 'measure', measure)
  out = tmp_path / 'tiles.json'
  with pytest.raises(RuntimeError, match='stopped'):
    pallas_tiles.main(['--quick', '--repeats', '1', '--batch_at', '32:1', '64:1',
                       '--out', str(out)])
  row, = json.loads(out.read_text())['tiles']
  assert (row['head_dim'], row['max_length']) == (16, 32)
  # The sweep's next command (here the case stopped above) adds its row to them.
  monkeypatch.setattr(pallas_tiles, 'measure', real)
  pallas_tiles.main(['--quick', '--repeats', '1', '--batch_at', '64:1', '--out', str(out)])
  assert [(r['head_dim'], r['max_length']) for r in json.loads(out.read_text())['tiles']] == [
      (16, 32), (16, 64)]
  # Rows measured on another device are not kept.
  out.write_text(json.dumps(dict(json.loads(out.read_text()), device='another GPU')))
  pallas_tiles.main(['--quick', '--repeats', '1', '--batch_at', '64:1', '--out', str(out)])
  assert [(r['head_dim'], r['max_length']) for r in json.loads(out.read_text())['tiles']] == [
      (16, 64)]


def test_plain_attention_takes_the_fused_kernel_where_the_table_measured_it_faster(
    tmp_path, monkeypatch, device_memory):
  """cuDNN for dot_product and rotary on a GPU unless the tiles table's row
  for the head dim and length has the fused kernel's ms below cuDNN's; the
  other schemes are not moved by it, and the CPU never reads it."""
  _tiles_file(tmp_path, monkeypatch, [dict(_row(64, 4096, 64, 64, 4, 2), ms=0.5, cudnn_ms=0.7),
                                      dict(_row(64, 8192, 128, 64, 8, 2), ms=1.9, cudnn_ms=1.4),
                                      dict(_row(128, 4096, 64, 64, 4, 2), ms=0.8, cudnn_ms=None)])
  pick = lambda name, n, d: _pick('gpu', name, 2, n, n, d=d, dtype='bfloat16')  # noqa: E731
  assert pick('dot_product', 2048, 64) == pick('rotary', 4096, 64) == 'pallas'
  assert pick('dot_product', 8192, 64) == pick('dot_product', 16384, 64) == 'cudnn'
  assert pick('dot_product', 2048, 128) == 'cudnn'  # no cuDNN time in its row
  assert pick('alibi', 8192, 64) == 'pallas'
  assert _pick('cpu', 'dot_product', 2, 2048, 2048, d=64, dtype='bfloat16') != 'pallas'
