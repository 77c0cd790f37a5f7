"""GPipe's fill-drain schedule: the predicted timeline of K stages over M micro-batches, and its picture.

Forward: stage k runs micro-batch i at forward clock tick i + k. Once every forward is done the pipeline drains
backwards: last micro-batch first, last stage first. With equal stage costs the idle fraction ("bubble") is
(K-1)/(M+K-1) whatever the backward/forward ratio; unbalanced stages or per-stage rematerialization do worse, and
`predict` shows by how much before anything is run.

`render_text` draws the timeline for logs, `render_png` / `image_tensor` for files and `tf.summary.image` (a titled,
labelled picture with a legend, drawn with Pillow, which TensorBoard itself depends on).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
from typing import TYPE_CHECKING, Sequence

import numpy as np

from gpipe_tf.hyperparams import ParamsError

if TYPE_CHECKING:  # TensorFlow is only needed for the picture; predicting and text stay import-light.
    import tensorflow as tf

__all__ = ["Cell", "Timeline", "PictureLayout", "predict", "render_text", "render_png", "image_tensor", "picture_layout",
           "title",
           "FORWARD_COLORS", "BACKWARD_COLORS", "IDLE_COLOR", "GRID_COLOR", "TEXT_COLOR"]

FORWARD = "F"
BACKWARD = "B"

# Two shades per phase, alternating with the micro-batch parity, so neighbouring cells stay distinguishable
# even where a grid line is hard to see in a downscaled summary image.
FORWARD_COLORS = ((110, 160, 230), (150, 190, 245))
BACKWARD_COLORS = ((235, 140, 80), (245, 180, 125))
IDLE_COLOR = (255, 255, 255)
GRID_COLOR = (205, 205, 205)
TEXT_COLOR = (25, 25, 25)

# A pathological cost spread (e.g. 1e-6 next to 1.0) would otherwise make a default-tick picture millions of
# columns wide; the default tick is coarsened to stay under this, an explicit one is refused above it.
_MAX_COLUMNS = 4096
_MAX_PIXELS = 64 * 1024 * 1024
# The picture: the grid scaled to about this many pixels wide by default, never more than _AUTO_MAX_PIXELS (a
# summary image TensorBoard shows at once); text sizes in pixels; the margin between parts.
_TARGET_WIDTH = 1200
_AUTO_MAX_PIXELS = 16 * 1024 * 1024
_TITLE_PX = 20
_LABEL_PX = 16
_PAD = 10

# 3x5 bitmap digits, '#' = ink. Tiny on purpose: scaled up by an integer factor to fit the cell.
_GLYPHS = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", ".##", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
}
_SEQUENCES = (collections.abc.Sequence, np.ndarray)

_GLYPH_MASKS = {d: np.array([[ch == "#" for ch in row] for row in rows], dtype=bool) for d, rows in _GLYPHS.items()}


@dataclasses.dataclass
class Cell:
    """One unit of work: `stage` running micro-batch `micro_batch` forward ('F') or backward ('B')."""

    stage: int
    micro_batch: int
    phase: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        """end - start."""
        return self.end - self.start


@dataclasses.dataclass
class Timeline:
    """A predicted schedule: every cell with its start and end, the makespan and the idle ("bubble") fraction."""

    num_stages: int
    num_micro_batches: int
    cells: list[Cell]
    makespan: float
    bubble_fraction: float
    remat: tuple[bool, ...] | None = None  # per stage: its backward recomputes its forward

    def ideal_bubble_fraction(self) -> float:
        """GPipe's bound (K-1)/(M+K-1), reached exactly when all stages cost the same."""
        k, m = self.num_stages, self.num_micro_batches
        return (k - 1) / (m + k - 1)

    def cell(self, stage: int, micro_batch: int, phase: str) -> Cell:
        """The cell of `stage` running `micro_batch` in `phase` ('F' or 'B')."""
        for c in self.cells:
            if c.stage == stage and c.micro_batch == micro_batch and c.phase == phase:
                return c
        raise KeyError(f"no cell stage={stage} micro_batch={micro_batch} phase={phase!r} in this timeline")

    def stage_cells(self, stage: int) -> list[Cell]:
        """The cells of `stage` in the order it runs them."""
        return sorted((c for c in self.cells if c.stage == stage), key=lambda c: c.start)


def _check_count(name: str, value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ParamsError(f"{name}={value!r} is invalid: it must be an int >= 1 ({what})")
    return int(value)


def _check_positive(name: str, value: object, what: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value <= 0):
        raise ParamsError(f"{name}={value!r} is invalid: it must be a finite number > 0 ({what})")
    return float(value)


def _check_costs(stage_costs: Sequence[float] | None, num_stages: int) -> list[float]:
    if stage_costs is None:
        return [1.0] * num_stages
    if isinstance(stage_costs, (str, bytes)) or not isinstance(stage_costs, _SEQUENCES):
        raise ParamsError(f"stage_costs={stage_costs!r} is invalid: give a list of {num_stages} forward costs, "
                          "one per stage (or None for equal stages)")
    if len(stage_costs) != num_stages:
        raise ParamsError(f"stage_costs={list(stage_costs)!r} has {len(stage_costs)} entries for "
                          f"num_stages={num_stages}: give exactly one forward cost per stage")
    return [_check_positive(f"stage_costs[{k}]", c, "a stage's forward cost, e.g. its measured seconds")
            for k, c in enumerate(stage_costs)]


def _check_remat(remat: Sequence[bool] | bool, num_stages: int) -> list[bool]:
    if isinstance(remat, (bool, np.bool_)):
        return [bool(remat)] * num_stages
    if isinstance(remat, (str, bytes)) or not isinstance(remat, _SEQUENCES):
        raise ParamsError(f"remat={remat!r} is invalid: give True/False for all stages or a list of "
                          f"{num_stages} bools, one per stage")
    if len(remat) != num_stages:
        raise ParamsError(f"remat={list(remat)!r} has {len(remat)} entries for num_stages={num_stages}: "
                          "give exactly one bool per stage")
    for k, r in enumerate(remat):
        if not isinstance(r, (bool, np.bool_)):
            raise ParamsError(f"remat[{k}]={r!r} is invalid: it must be True or False")
    return [bool(r) for r in remat]


def predict(num_stages: int, num_micro_batches: int, stage_costs: Sequence[float] | None = None,
            backward_ratio: float = 2.0, remat: Sequence[bool] | bool = False) -> Timeline:
    """Simulates GPipe's fill-drain schedule and returns its timeline.

    Each stage runs one cell at a time, in GPipe's order: forwards of micro-batches 0..M-1, then backwards of
    M-1..0. F(k, i) waits for F(k-1, i); B(k, i) waits for every forward of stage k and for B(k+1, i) (the last
    stage's backward for F(K-1, i)). F(k, i) costs stage_costs[k] (default 1.0 each); B(k, i) costs
    backward_ratio * stage_costs[k], plus stage_costs[k] again where stage k is rematerialized (its forward is
    recomputed inside the backward).

    Args:
      num_stages: K, the number of pipeline stages.
      num_micro_batches: M, the number of micro-batches per batch.
      stage_costs: forward cost of each stage (any time unit), or None for K equal stages.
      backward_ratio: backward cost / forward cost of a stage.
      remat: whether each stage recomputes its forward in the backward; one bool applies to all stages.

    Raises:
      ParamsError: an argument is out of range or has the wrong length.
    """
    k_stages = _check_count("num_stages", num_stages, "the number of pipeline stages")
    m = _check_count("num_micro_batches", num_micro_batches, "the number of micro-batches per batch")
    costs = _check_costs(stage_costs, k_stages)
    ratio = _check_positive("backward_ratio", backward_ratio, "backward cost / forward cost, typically 2")
    recompute = _check_remat(remat, k_stages)

    # The order on each stage is fixed and the dependencies are acyclic, so visiting cells in a topological
    # order (forwards stage by stage, then backwards micro-batch by micro-batch from the last stage) gives every
    # cell its earliest start: the same result as an event-driven simulation, without a queue.
    stage_free = [0.0] * k_stages
    forward_end = [[0.0] * m for _ in range(k_stages)]
    cells: list[Cell] = []
    for k in range(k_stages):
        for i in range(m):
            start = max(stage_free[k], forward_end[k - 1][i] if k > 0 else 0.0)
            end = start + costs[k]
            forward_end[k][i] = stage_free[k] = end
            cells.append(Cell(k, i, FORWARD, start, end))
    # stage_free[k] is now the end of stage k's last forward, so "all forwards done" is implied by stage order.
    backward_cost = [ratio * c + (c if r else 0.0) for c, r in zip(costs, recompute)]
    for i in reversed(range(m)):
        upstream_grad_ready = forward_end[k_stages - 1][i]
        for k in reversed(range(k_stages)):
            start = max(stage_free[k], upstream_grad_ready)
            end = start + backward_cost[k]
            stage_free[k] = upstream_grad_ready = end
            cells.append(Cell(k, i, BACKWARD, start, end))

    cells.sort(key=lambda c: (c.start, c.stage))
    makespan = max(c.end for c in cells)
    busy = m * sum(costs) + m * sum(backward_cost)
    return Timeline(num_stages=k_stages, num_micro_batches=m, cells=cells, makespan=makespan,
                    bubble_fraction=1.0 - busy / (k_stages * makespan), remat=tuple(recompute))


def _check_timeline(timeline: object) -> Timeline:
    if not isinstance(timeline, Timeline):
        raise ParamsError(f"timeline={timeline!r} is invalid: pass the Timeline returned by predict(...)")
    return timeline


def _resolve_tick(timeline: Timeline, tick: float | None) -> tuple[float, int]:
    """(tick, number of columns) for drawing `timeline`; the default tick is the shortest cell's duration."""
    if tick is None:
        tick = min(c.duration for c in timeline.cells)
        tick = max(tick, timeline.makespan / _MAX_COLUMNS)
    else:
        tick = _check_positive("tick", tick, "the time one column stands for")
        if timeline.makespan / tick > _MAX_COLUMNS:
            raise ParamsError(f"tick={tick!r} would draw {math.ceil(timeline.makespan / tick)} columns (at most "
                              f"{_MAX_COLUMNS}): use tick >= {timeline.makespan / _MAX_COLUMNS:.6g} or None")
    # The epsilon keeps a makespan that is a whole number of ticks, up to rounding, from gaining an empty column.
    return tick, max(1, math.ceil(timeline.makespan / tick - 1e-9))


def _grid(timeline: Timeline, tick: float, columns: int) -> list[list[Cell | None]]:
    """grid[stage][column]: the cell running at the middle of that column, or None when the stage is idle.

    Sampling the midpoint shows every cell at least once when tick <= its duration, since any interval of one
    tick's length holds exactly one midpoint.
    """
    rows: list[list[Cell | None]] = []
    for k in range(timeline.num_stages):
        row: list[Cell | None] = []
        stage_cells = timeline.stage_cells(k)
        pos = 0
        for j in range(columns):
            mid = (j + 0.5) * tick
            while pos < len(stage_cells) and stage_cells[pos].end <= mid:
                pos += 1
            row.append(stage_cells[pos] if pos < len(stage_cells) and stage_cells[pos].start <= mid else None)
        rows.append(row)
    return rows


def render_text(timeline: Timeline, tick: float | None = None) -> str:
    """Draws `timeline` as text: a header line, then one row per stage ("stage 0 |...|").

    Each column is one tick of time (default: the shortest cell's duration, so every cell shows at least once)
    and is len(str(M-1)) + 1 characters wide. A forward tick shows the micro-batch number followed by a space
    ("3 "), a backward tick the number followed by a prime ("3'", as in a derivative), an idle tick a dot (". ").
    Numbers are right-aligned so that micro-batches >= 10 stay readable ("12'" next to " 3'"). A cell lasting
    several ticks repeats its label, so widths show durations.

    Raises:
      ParamsError: `tick` is not a positive number or would draw more than 4096 columns.
    """
    timeline = _check_timeline(timeline)
    tick, columns = _resolve_tick(timeline, tick)
    width = len(str(timeline.num_micro_batches - 1))
    stage_width = len(str(timeline.num_stages - 1))
    lines = [f"GPipe schedule K={timeline.num_stages} M={timeline.num_micro_batches}: "
             f"bubble {timeline.bubble_fraction:.1%} (bound {timeline.ideal_bubble_fraction():.1%}); "
             f"1 column = {tick:.4g}, n = forward, n' = backward, . = idle"]
    for k, row in enumerate(_grid(timeline, tick, columns)):
        text = []
        for c in row:
            if c is None:
                text.append(f"{'.':>{width}} ")
            else:
                text.append(f"{c.micro_batch:>{width}}" + (" " if c.phase == FORWARD else "'"))
        lines.append(f"stage {k:>{stage_width}} |{''.join(text)}|")
    return "\n".join(lines)


def _text_size(text: str, scale: int) -> tuple[int, int]:
    """(height, width) in pixels of `text` in the 3x5 font at `scale`, one scaled pixel between glyphs."""
    return 5 * scale, (4 * len(text) - 1) * scale


def _draw_text(image: np.ndarray, text: str, top: int, left: int, height: int, width: int, max_scale: int,
               color: tuple[int, int, int]) -> None:
    """Draws `text` centered in the box, at the largest scale <= max_scale that leaves a 2-pixel margin."""
    for scale in range(max_scale, 0, -1):
        text_h, text_w = _text_size(text, scale)
        if text_h <= height - 4 and text_w <= width - 4:
            break
    else:
        return  # too small to hold even a 1x glyph: a bare color block beats an unreadable smudge
    y = top + (height - text_h) // 2
    x = left + (width - text_w) // 2
    for ch in text:
        mask = np.kron(_GLYPH_MASKS[ch], np.ones((scale, scale), dtype=bool))
        image[y:y + text_h, x:x + 3 * scale][mask] = color
        x += 4 * scale


def _check_cell_px(cell_px: object) -> int:
    if isinstance(cell_px, bool) or not isinstance(cell_px, numbers.Integral) or not 8 <= cell_px <= 256:
        raise ParamsError(f"cell_px={cell_px!r} is invalid: it must be an int in [8, 256] (pixels per tick and "
                          "per stage row), or None to scale the grid to about 1200 pixels wide")
    return int(cell_px)


def _auto_cell_px(num_stages: int, columns: int) -> int:
    """Pixels per tick and stage row: the grid about _TARGET_WIDTH wide, cells 16..48 pixels (at least 8 for a
    huge grid, which is also kept under _AUTO_MAX_PIXELS)."""
    cell_px = min(48, max(16, _TARGET_WIDTH // columns))
    while cell_px > 8 and columns * num_stages * cell_px * cell_px > _AUTO_MAX_PIXELS:
        cell_px -= 1
    return cell_px


def _grid_picture(timeline: Timeline, cell_px: int, tick: float, columns: int) -> np.ndarray:
    """The cells alone as a uint8 [K * cell_px + 1, columns * cell_px + 1, 3] array, grid lines included."""
    # About 60% of the row height for digits: readable, with room left for the grid and margins.
    max_scale = max(1, (cell_px * 3 // 5) // 5)
    height = timeline.num_stages * cell_px + 1
    width = columns * cell_px + 1
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = IDLE_COLOR
    image[::cell_px, :] = GRID_COLOR
    image[:, ::cell_px] = GRID_COLOR
    for k, row in enumerate(_grid(timeline, tick, columns)):
        top = k * cell_px
        j = 0
        while j < columns:
            c = row[j]
            end = j + 1
            while end < columns and row[end] is c:
                end += 1
            if c is not None:
                left, right = j * cell_px, end * cell_px
                colors = FORWARD_COLORS if c.phase == FORWARD else BACKWARD_COLORS
                # Filling inside the grid lines erases the tick lines within a multi-tick cell: one block each.
                image[top + 1:top + cell_px, left + 1:right] = colors[c.micro_batch % 2]
                _draw_text(image, str(c.micro_batch), top, left, cell_px + 1, right - left + 1, max_scale,
                           TEXT_COLOR)
            j = end
    return image


@dataclasses.dataclass(frozen=True)
class PictureLayout:
    """Where render_png puts things: the grid's top-left pixel, its cell size and column count, the image size."""

    cell_px: int
    columns: int
    grid_top: int
    grid_left: int
    height: int
    width: int


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow's built-in scalable font (needs FreeType)
    except (TypeError, ValueError, OSError, ImportError):
        return ImageFont.load_default()  # a fixed bitmap font: smaller, still legible


def title(timeline: Timeline, schedule: str = "fill-drain") -> str:
    """The picture's title: schedule, K, M and the bubble fraction against GPipe's bound."""
    return (f"GPipe schedule {schedule}: K={timeline.num_stages} stages, M={timeline.num_micro_batches} "
            f"micro-batches, bubble {timeline.bubble_fraction:.1%} (bound {timeline.ideal_bubble_fraction():.1%})")


def _compose(timeline: Timeline, cell_px: int | None, schedule: str) -> tuple[np.ndarray, PictureLayout]:
    """The whole picture (title, stage axis, grid, time axis, legend) and its layout; see render_png."""
    from PIL import Image, ImageDraw

    timeline = _check_timeline(timeline)
    tick, columns = _resolve_tick(timeline, None)
    cell_px = _auto_cell_px(timeline.num_stages, columns) if cell_px is None else _check_cell_px(cell_px)
    grid_h, grid_w = timeline.num_stages * cell_px + 1, columns * cell_px + 1
    if grid_h * grid_w > _MAX_PIXELS:
        raise ParamsError(f"cell_px={cell_px} would draw a {grid_w}x{grid_h} grid (more than {_MAX_PIXELS} "
                          "pixels): use a smaller cell_px")
    title_font, label_font = _font(_TITLE_PX), _font(_LABEL_PX)
    scratch = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def size(text: str, font) -> tuple[int, int]:
        box = scratch.textbbox((0, 0), text, font=font)
        return box[2] - box[0], box[3]

    heading = title(timeline, schedule)
    stage_labels = [str(k) for k in range(timeline.num_stages)]
    axis_w = max(size("stage", label_font)[0], max(size(t, label_font)[0] for t in stage_labels)) + 2 * _PAD
    legend = [(FORWARD_COLORS[0], "forward of micro-batch n"),
              (BACKWARD_COLORS[0], "backward of n" + (" (recomputes its forward)" if any(timeline.remat or ())
                                                       else "")),
              (IDLE_COLOR, "idle (the bubble)")]
    swatch = _LABEL_PX
    legend_w = sum(swatch + _PAD + size(text, label_font)[0] + 3 * _PAD for _, text in legend)
    title_h, label_h = size(heading, title_font)[1], size("stage 0", label_font)[1]
    grid_top = _PAD + title_h + _PAD + label_h + _PAD // 2
    grid_left = axis_w
    time_top = grid_top + grid_h + _PAD // 2
    legend_top = time_top + label_h + _PAD
    height = legend_top + swatch + _PAD
    width = max(grid_left + grid_w + _PAD, _PAD + size(heading, title_font)[0] + _PAD, _PAD + legend_w)

    canvas = Image.new("RGB", (width, height), IDLE_COLOR)
    canvas.paste(Image.fromarray(_grid_picture(timeline, cell_px, tick, columns)), (grid_left, grid_top))
    draw = ImageDraw.Draw(canvas)
    draw.text((_PAD, _PAD), heading, fill=TEXT_COLOR, font=title_font)
    draw.text((_PAD, grid_top - label_h - _PAD // 2), "stage", fill=TEXT_COLOR, font=label_font)
    for k, text in enumerate(stage_labels):
        w, h = size(text, label_font)
        draw.text((grid_left - _PAD - w, grid_top + k * cell_px + (cell_px - h) // 2), text, fill=TEXT_COLOR,
                  font=label_font)
    draw.text((grid_left, time_top), f"time ->   (1 column = {tick:.3g} forward-cost units)",
              fill=TEXT_COLOR, font=label_font)
    x = _PAD
    for color, text in legend:
        draw.rectangle([x, legend_top, x + swatch, legend_top + swatch], fill=color, outline=GRID_COLOR)
        draw.text((x + swatch + _PAD, legend_top), text, fill=TEXT_COLOR, font=label_font)
        x += swatch + _PAD + size(text, label_font)[0] + 3 * _PAD
    layout = PictureLayout(cell_px=cell_px, columns=columns, grid_top=grid_top, grid_left=grid_left, height=height,
                           width=width)
    return np.asarray(canvas, dtype=np.uint8), layout


def picture_layout(timeline: Timeline, cell_px: int | None = None, schedule: str = "fill-drain") -> PictureLayout:
    """Where render_png(timeline, cell_px, schedule) draws the grid, and the picture's size."""
    return _compose(timeline, cell_px, schedule)[1]


def render_png(timeline: Timeline, cell_px: int | None = None, schedule: str = "fill-drain") -> bytes:
    """Draws `timeline` as a PNG and returns its bytes.

    On top, a title with the schedule's name, K, M and the bubble fraction next to GPipe's bound. Below it the
    grid: rows are stages (labelled on the left under a "stage" heading), columns time ticks of the shortest
    cell's duration, each cell_px pixels (None: chosen so that the grid is about 1200 pixels wide, 16 to 48 pixels
    a cell); a time arrow under the grid and a legend at the bottom. Forward cells are blue, backward orange, in
    two shades alternating with the micro-batch parity; idle ticks are white, grid lines light gray. Each cell
    is one block with its micro-batch number drawn in a 3x5 bitmap font scaled to fit; the other text uses
    Pillow's built-in font. `picture_layout` says where the grid is.

    Raises:
      ParamsError: `cell_px` is not None or an int in [8, 256], or the picture would be too large.
    """
    import tensorflow as tf  # deferred: see the TYPE_CHECKING import above

    return tf.io.encode_png(_compose(timeline, cell_px, schedule)[0]).numpy()


def image_tensor(timeline: Timeline, cell_px: int | None = None, schedule: str = "fill-drain") -> tf.Tensor:
    """The render_png picture as a [1, H, W, 3] uint8 tensor, ready for `tf.summary.image`."""
    import tensorflow as tf  # deferred: see the TYPE_CHECKING import above

    return tf.convert_to_tensor(_compose(timeline, cell_px, schedule)[0][np.newaxis])
