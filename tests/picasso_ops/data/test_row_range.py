"""RowRangeReader: numbered batches over Criteo TSV and parquet files (GBA's batch numbers over file data)."""
import pytest

from picasso_ops.data import CriteoTSVReader, DataError, ParquetCTRReader
from picasso_ops.data.row_range import RowRangeReader
from tests.picasso_ops.data.test_files import random_rows, row_ids, to_parquet
from tests.picasso_ops.data.test_files import two_files as files  # noqa: F401 - a fixture: 87 rows in 2 files, row 50 bad

B = 8


def _tsv(files, **kw):
    return RowRangeReader(lambda start: CriteoTSVReader(files, B, start_row=start, max_bad_fraction=0.1,
                                                        chunk_bytes=700), **kw)


@pytest.mark.parametrize("reopen_rows", [1 << 18, 5])
def test_batches_by_number_hold_exactly_their_rows(files, reopen_rows):
    reader = _tsv(files, reopen_rows=reopen_rows)
    assert reader.num_rows == 87
    for k in (0, 1, 3, 4, 7, 10):  # a worker's increasing numbers, with gaps (others took the rest)
        got = row_ids([reader.rows(k * B, min((k + 1) * B, 87))])
        assert got == [i for i in range(k * B, min((k + 1) * B, 87)) if i != 50], k


def test_parquet_batches_by_number(tmp_path):
    path = to_parquet(random_rows(50, seed=9), tmp_path / "p.parquet", row_group_size=7)
    reader = RowRangeReader(lambda start: ParquetCTRReader(path, B, start_row=start))
    assert reader.num_rows == 50
    assert row_ids([reader.rows(16, 24)]) == list(range(16, 24))
    assert row_ids([reader.rows(40, 50)]) == list(range(40, 50))


def test_backwards_out_of_range_and_all_bad_ranges_are_clear_errors(files, tmp_path):
    reader = _tsv(files)
    reader.rows(16, 24)
    with pytest.raises(ValueError, match="forward only"):
        reader.rows(8, 16)
    with pytest.raises(IndexError, match="outside the files' 87 rows"):
        reader.rows(80, 96)
    one_bad = _tsv(files)
    with pytest.raises(DataError, match=r"rows \[50, 51\) hold no good row"):
        one_bad.rows(50, 51)
    with pytest.raises(ValueError, match="world_size=1"):
        RowRangeReader(lambda start: CriteoTSVReader(files, B, world_size=2))
