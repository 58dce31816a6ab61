"""Data pipeline of picasso_ops: CTR batches, a synthetic stream with a planted teacher,
streaming TSV/CSV and parquet readers sharded by rank (Criteo's layout, or a `DataSchema`'s columns),
a background-thread prefetcher, and CTR metrics.

    from picasso_ops.data import SyntheticConfig, SyntheticCTRStream, CriteoTSVReader, DataSchema, auc
    stream = SyntheticCTRStream(SyntheticConfig(seed=3), batch_size=4096, rank=0, world_size=2)
    reader = CriteoTSVReader(["day_0.tsv"], batch_size=4096, rank=0, world_size=2)
    csv = CriteoTSVReader("ratings.csv", 4096, schema=DataSchema.load("ratings_schema.json"))
"""
from .batch import CTRBatch
from .criteo import CriteoTSVReader, TextCTRReader
from .metrics import auc, bayes_optimal_auc, bayes_optimal_log_loss, log_loss
from .parquet import ParquetCTRReader
from .prefetch import Prefetcher, PrefetchTimeout
from .quality import BadRow, DataError
from .schema import CategoricalColumn, DataSchema
from .synthetic import SyntheticConfig, SyntheticCTRGenerator, SyntheticCTRStream

__all__ = [
    "CTRBatch",
    "SyntheticConfig",
    "SyntheticCTRGenerator",
    "SyntheticCTRStream",
    "CriteoTSVReader",
    "TextCTRReader",
    "DataSchema",
    "CategoricalColumn",
    "ParquetCTRReader",
    "Prefetcher",
    "PrefetchTimeout",
    "DataError",
    "BadRow",
    "auc",
    "log_loss",
    "bayes_optimal_auc",
    "bayes_optimal_log_loss",
]
