"""Do attention bottlenecks match full cross-attention at lower cost? ./launch.sh sweep experiments/sweeps/two_stream_fusion.py --jobs=2

Nagrani et al. 2021's question at CPU scale, on experiments/two_stream.py (4
layers, d 64; the same budget for every row):
  early          one joint sequence from layer 0 (full attention across streams);
  late_L         each stream alone for L layers, then joint; late_4: the
                 streams meet only in the classifier;
  bottleneck_B   from layer 2, the streams exchange only through B shared
                 tokens (B = 1, 4, 16).
Studies: presence_claims (B needs k bits from A) and presence_control (the
label is A's alone). Table and
figure: test accuracy, the train step's FLOPs (XLA's cost analysis) and the
steps per second. Results in benchmarks/results/two_stream_fusion/ with
`--results benchmarks/results/two_stream_fusion`.
"""

EARLY = {'model.fusion': 'early', 'model.fusion_layer': 0}
LATE = {f'late_{layer}': {'model.fusion': 'late', 'model.fusion_layer': layer}
        for layer in (2, 3, 4)}
BOTTLENECK = {f'bottleneck_{b}': {'model.fusion': 'bottleneck', 'model.fusion_layer': 2,
                                  'model.fusion_bottlenecks': b} for b in (1, 4, 16)}
ROWS = {'early': EARLY, **LATE, **BOTTLENECK}
METRICS = {'test.accuracy': 'test accuracy', 'train.step_flops': 'FLOPs per train step',
           'train.steps_per_sec': 'train steps/s'}


def study(task, rows):
  return {'experiment': 'experiments/two_stream.py', 'overrides': {'data.task': task},
          'rows': rows, 'metrics': METRICS}


def get_sweep():
  return {
      'seeds': [0, 1, 2],
      'out': 'workdirs/two_stream_fusion',
      'studies': {
          'presence_claims': study('presence_claims', ROWS),
          'presence_control': study('presence_control',
                                    {k: ROWS[k] for k in ('early', 'late_4', 'bottleneck_4')}),
      },
      'scatters': {'accuracy_against_flops': {
          'x': 'train.step_flops', 'xlabel': 'FLOPs per train step (XLA cost analysis)',
          'y': 'test.accuracy', 'ylabel': 'test accuracy',
          'studies': ['presence_claims']}},
  }
