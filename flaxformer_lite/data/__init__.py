"""Input data: TFDS builders, tokenizers, batching, and the data's config rules.

loading.py    load(config.data) -> Dataset (prepared once, read back)
corpora.py    TFDS builders of the real corpora; synthetic.py the generated tasks
tokenizers.py sentencepiece, char, byte
pipeline.py   batch iterators (resumable), packing, evaluation batches
masking.py    BERT's masked-LM corruption
validation.py config.data's rules (main.validate; not imported here, so that
              reading data imports no model code)
"""
from flaxformer_lite.data.corpora import DataError
from flaxformer_lite.data.loading import (BUILDER_NAMES, KINDS, OVERLONG, REAL_TASKS, TASKS,
                                          Dataset, default_data_dir, load)
from flaxformer_lite.data.pipeline import (Batches, BucketedBatches, LMWindows, PackedBatches,
                                           eval_batches, lm_eval_arrays, pad_rows)

__all__ = ['BUILDER_NAMES', 'Batches', 'BucketedBatches', 'DataError', 'Dataset', 'KINDS',
           'LMWindows', 'OVERLONG', 'PackedBatches', 'REAL_TASKS', 'TASKS', 'default_data_dir',
           'eval_batches', 'lm_eval_arrays', 'load', 'pad_rows']
