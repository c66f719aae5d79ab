"""benchmarks/gpu_check.sh end to end in its reduced form (--quick), as a GPU
machine runs it in full: every section runs and lands in one table."""
import json
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_quick_runs_every_section_and_writes_its_table(tmp_path, shared_data, tfds_dir):
  out = tmp_path / 'gpu'
  proc = subprocess.run(
      ['benchmarks/gpu_check.sh', '--quick', '--out', str(out), '--budget', '400'],
      cwd=REPO, capture_output=True, text=True, timeout=600,
      env={**os.environ, 'FFL_SHARED_DATA': shared_data, 'TFDS_DATA_DIR': tfds_dir})
  assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
  results = json.loads((out / 'results.json').read_text())
  assert results['quick'] and not results['failed']
  rows = {(section, quantity): value for section, quantity, value, _ in results['rows']}
  sections = {section for section, _ in rows}
  assert {'compile', 'recipe', 'kernels', 'mfu', 'mha'} <= sections, sections
  # the recipe's programs compiled under the project's XLA settings, with a step time
  compiled = [v for (s, _), v in rows.items() if s == 'compile']
  assert len(compiled) == 1 and all(float(v.split('; ')[1]) > 0 for v in compiled), compiled
  # the second run of the recipe found every step it compiles in the cache
  assert float(rows['recipe', 'first step, empty cache (s after launch)']) > 0
  served = rows['recipe', '  served by the cache']
  assert 'train step' in served and 'eval step' in served and 'greedy sample' in served, served
  # on CPU at n=64, auto takes the dense path
  kernels = [v for (s, q), v in rows.items() if s == 'kernels' and 'attention only' not in q]
  assert kernels and all(v.endswith('auto -> dense') for v in kernels), kernels
  # the Pallas kernel (interpreted here) timed beside XLA's attention
  fused = [v for (s, q), v in rows.items() if s == 'kernels' and 'attention only' in q]
  assert len(fused) == 1 and all(f'{k} ' in fused[0] for k in ('pallas', 'pallas alibi', 'xla'))
  assert 'failed' not in fused[0], fused
  assert (out / 'results.md').read_text().count('\n| ') >= len(rows)
