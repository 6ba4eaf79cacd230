"""How the CPU kernels walk ``(N, C, ...)`` tensors of any layout without copying them.

Every element is addressed as ``(row, channel, inner)``: ``inner`` runs along the input's
smallest-stride axis other than the channel axis (a merged run, e.g. ``H*W`` of NCHW), and
``row`` enumerates the remaining axes (up to four, decomposed by division). When the channel
axis itself has the smallest stride (channels-last, ``(N, C)``), ``inner`` has one element
and the kernels walk channels innermost. Each tensor of a problem keeps its own strides
(the walk follows the input's memory order), so NCHW, channels-last, padded and mixed
layouts share one kernel. The layout depends only on descriptors: it is built once.

Dense channels-last data (every tensor's rows of ``C`` channels follow each other) is
walked ``tile`` rows at a time, as rows of ``tile * C`` values: a row of 3 channels is too
short a loop to vectorize, a row of 48 values (16 rows) is not. The kernels then see the
per-channel values repeated ``tile`` times, and add the sums of the repeats up.
"""

from dataclasses import dataclass

import numpy as np

from ..tensor import TensorDesc

ROW_DIMS = 4  # an (N, C, D, H, W) input has at most four non-channel axes
TILE_VALUES = 256  # a tiled run has at most this many values (when C is smaller)
SLOTS = 5  # data tensors of a pass, at most (the backward's x, dy, y, grad_input, grad_z)
# Columns of ``Layout.strides``: channel, inner, then one per row dimension.
STRIDE_COLUMNS = 2 + ROW_DIMS


def _mergeable(outer: int, inner: int, inner_size: int, descs: list[TensorDesc]) -> bool:
    """Whether axis ``outer`` continues axis ``inner`` in memory in every tensor."""
    return all(d.strides[outer] == d.strides[inner] * inner_size for d in descs)


@dataclass(frozen=True)
class Layout:
    """The walk shared by a problem's data tensors (``descs``, the input first).

    ``geometry``: channels, inner size, row count, whether channels are innermost, the row
    dimensions (outermost first, padded with 1), then ``tile``: rows of channels walked
    as one row (1 unless channels-last data is dense; rows are then counted in tiles).
    ``strides[t]``: tensor ``t``'s element strides for ``STRIDE_COLUMNS`` (``SLOTS`` rows;
    an absent tensor, never read, has the input's, so that only present tensors decide how
    runs are walked: a zero stride is a broadcast operand's).
    ``spans[t]``: elements from its first to its last element, plus one (the length of the
    kernels' flat view of it).
    """

    geometry: np.ndarray
    strides: np.ndarray
    spans: tuple[int, ...]
    channels: int
    count: int  # values per channel

    @classmethod
    def of(cls, descs: list[TensorDesc | None]) -> "Layout":
        present = [d for d in descs if d is not None]
        x = present[0]
        c = x.shape[1]
        # Non-channel axes with more than one element, outermost (largest stride) first.
        axes = sorted(
            (a for a in range(x.ndim) if a != 1 and x.shape[a] > 1),
            key=lambda a: (-x.strides[a], -a),
        )
        channel_inner = c > 1 and (not axes or x.strides[1] < x.strides[axes[-1]])
        inner_axes: list[int] = []
        if axes and not channel_inner:
            inner_axes = [axes.pop()]
            while axes and _mergeable(axes[-1], inner_axes[0], x.shape[inner_axes[0]], present):
                inner_axes.insert(0, axes.pop())
        # Merge row axes that continue each other in every tensor, then pad to ROW_DIMS.
        rows: list[list[int]] = []
        for a in axes:
            if rows and _mergeable(rows[-1][-1], a, x.shape[a], present):
                rows[-1].append(a)
            else:
                rows.append([a])
        if len(rows) > ROW_DIMS:
            raise AssertionError(f"more than {ROW_DIMS} row dimensions for shape {x.shape}")
        row_sizes = [int(np.prod([x.shape[a] for a in g])) for g in rows]
        tile = 1
        if (
            channel_inner
            and len(rows) == 1
            and all(d.strides[1] == 1 and d.strides[rows[0][-1]] == c for d in present)
        ):
            most = max(1, TILE_VALUES // c)
            tile = max(t for t in range(1, most + 1) if row_sizes[0] % t == 0)
            row_sizes[0] //= tile
        row_sizes = [1] * (ROW_DIMS - len(rows)) + row_sizes
        inner = int(np.prod([x.shape[a] for a in inner_axes])) if inner_axes else 1
        strides = np.zeros((SLOTS, STRIDE_COLUMNS), dtype=np.int64)
        spans = []
        for t, d in enumerate(descs):
            walked = x if d is None else d  # an absent tensor: the input's strides, no data
            strides[t, 0] = walked.strides[1]
            strides[t, 1] = walked.strides[inner_axes[-1]] if inner_axes else 0
            for k, g in enumerate(rows):
                strides[t, 2 + ROW_DIMS - len(rows) + k] = walked.strides[g[-1]] * tile
            extent = (
                0
                if d is None
                else 1 + sum((n - 1) * s for n, s in zip(d.shape, d.strides, strict=True))
            )
            spans.append(extent)
        geometry = np.array(
            [c, inner, int(np.prod(row_sizes)), int(channel_inner), *row_sizes, tile],
            dtype=np.int64,
        )
        return cls(geometry, strides, tuple(spans), c, x.numel // c)

    def items(self, chunks: int) -> np.ndarray:
        """About ``chunks`` work items, rows of ``(first channel, end channel, first row,
        end row)`` (int64): channels innermost, every channel and rows split in ``chunks``;
        otherwise ``chunks`` blocks of channels, rows split too when there are fewer
        channels. ``items(1)`` is the whole tensor."""
        rows = int(self.geometry[2])
        channels = self.channels * int(self.geometry[-1])  # the tiled run's values
        blocks = 1 if self.geometry[3] else min(channels, chunks)
        split = min(rows, -(-chunks // blocks))
        return np.array(
            [
                (b * channels // blocks, (b + 1) * channels // blocks, s * rows // split,
                 (s + 1) * rows // split)
                for b in range(blocks)
                for s in range(split)
            ],
            dtype=np.int64,
        )  # fmt: skip
