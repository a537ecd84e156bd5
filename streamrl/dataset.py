"""Prompt datasets: a local JSONL or Parquet file, or an env's own generator, indexed by position."""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names the file and row."""


class Prompts:
    """Row ``i`` of a finite dataset (repeating by epoch, each epoch in its own order when ``seed`` is given),
    or item ``i`` of an endless generator. Any index maps to the same item in every process that asks."""

    def __init__(self, rows: list[dict[str, Any]] | None = None,
                 generator: Callable[[], Iterator[dict[str, Any]]] | None = None, seed: int | None = None):
        if (rows is None) == (generator is None):
            raise ValueError("Prompts needs rows or a generator")
        if rows is not None and not rows:
            raise DatasetError("the dataset has no rows")
        self.rows, self.seed = rows, seed
        self._made: list[dict[str, Any]] = []
        self._source = generator() if generator else None
        # two epochs: a claim let go near an epoch's end is served again after the next one began
        self._order = functools.lru_cache(maxsize=2)(
            lambda epoch: np.random.default_rng([seed % 2**64, epoch]).permutation(len(rows)))

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.rows is not None:
            epoch, i = divmod(index, len(self.rows))
            return self.rows[i if self.seed is None else int(self._order(epoch)[i])]
        if index >= len(self._made):  # the generator is deterministic: extend to the index
            self._made.extend(itertools.islice(self._source, index + 1 - len(self._made)))
        return self._made[index]


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl or .parquet file, or of a Hugging Face dataset saved with ``save_to_disk``."""
    path = Path(path)
    if path.is_dir():
        return _hf_rows(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    if path.suffix == ".jsonl":
        return [_row(line, path, n) for n, line in enumerate(path.read_bytes().splitlines(), 1) if line.strip()]
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            return pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise DatasetError(f"{path}: not a readable Parquet file: {e}") from None
    raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl or .parquet")


def _hf_rows(path: Path) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{path} is a directory: reading a saved Hugging Face dataset needs `pip install datasets`") \
            from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DatasetError(f"{path}: not a dataset saved with save_to_disk: {e}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DatasetError(f"{path}: a DatasetDict without a 'train' split ({', '.join(loaded)})")
        loaded = loaded["train"]
    return loaded.to_list()


def _row(line: bytes, path: Path, n: int) -> dict[str, Any]:
    try:
        row = json.loads(line.decode())
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}:{n}: not UTF-8 text: {e}") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{n}: not valid JSON: {e}") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
    return row
