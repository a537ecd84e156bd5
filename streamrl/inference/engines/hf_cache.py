"""The hf engine's KV cache layer: one buffer per layer with spare rows and columns, so a decode step, an
admission and a retirement each touch only what they change."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class SlackLayer(DynamicLayer):
    """A KV layer kept in a buffer with spare rows (sequences) and columns (positions).

    transformers' DynamicLayer concatenates on every token, copying the whole cache each decode step;
    here a step writes one column in place, an admission writes its own rows after the last, and a
    retirement moves only the rows that fill its holes. The buffer doubles when full, so growth costs
    amortised O(1) per token and per sequence.
    """

    @classmethod
    def empty_like(cls, keys: torch.Tensor, values: torch.Tensor, max_rows: int) -> SlackLayer:
        """No rows yet; ``append_rows`` sizes the buffers (up to ``max_rows`` rows) when the first arrive."""
        layer = cls()
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        layer.max_rows, layer.rows, layer.length = max_rows, 0, 0
        layer._k, layer._v = keys[:0, :, :0], values[:0, :, :0]
        layer._set_length(0)
        return layer

    def _set_length(self, n: int) -> None:
        self.length = n
        self.keys, self.values = self._k[: self.rows, :, :n], self._v[: self.rows, :, :n]

    def _resize(self, rows: int, columns: int, left: int = 0) -> None:
        """Reallocate for at least ``rows`` x ``columns`` (doubling), moving what is there ``left`` columns right."""
        have_rows, have_cols = self._k.shape[0], self._k.shape[2]
        cap_rows = have_rows if rows <= have_rows else max(rows, min(2 * have_rows, self.max_rows))
        cap_cols = have_cols if columns <= have_cols else max(columns + 64, 2 * have_cols)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_empty(cap_rows, old.shape[1], cap_cols, old.shape[3])  # unused cells are written first
            new[: self.rows, :, :left] = 0
            new[: self.rows, :, left: left + self.length] = old[: self.rows, :, : self.length]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[2]:
            self._resize(self.rows, end)
        self._k[: self.rows, :, self.length: end] = key_states
        self._v[: self.rows, :, self.length: end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add prefilled rows after the last, right-aligned and left-padded with zeros."""
        width, end = keys.shape[2], self.rows + keys.shape[0]
        if width > self.length:  # prompts wider than the batch: pad the batch on the left
            self._resize(end, width, left=width - self.length)
            self.length = width
        elif end > self._k.shape[0]:
            self._resize(end, self.length)
        start = self.length - width
        for buffer, new in ((self._k, keys), (self._v, values)):
            buffer[self.rows: end, :, :start] = 0
            buffer[self.rows: end, :, start: self.length] = new
        self.rows = end
        self._set_length(self.length)

    def move_rows(self, sources: list[int], targets: list[int], rows: int) -> None:
        """Copy rows ``sources`` onto rows ``targets``, then keep the first ``rows``."""
        if sources:
            for buffer in (self._k, self._v):
                buffer[targets, :, : self.length] = buffer[sources, :, : self.length]
        self.rows = rows
        self._set_length(self.length)

    def drop_left(self, n: int) -> None:
        """Forget the first ``n`` positions (padding for every row)."""
        self._k, self._v = self._k[:, :, n:], self._v[:, :, n:]
        self._set_length(self.length - n)
