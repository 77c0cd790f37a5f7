"""Pictures of pipeline timelines (`gpipe_tf.gpipe.timeline`): text for logs, PNG for files and TensorBoard.

`render_text` draws a timeline for logs, `render_png` / `image_tensor` for files and `tf.summary.image` (a titled,
labelled picture with a legend, drawn with Pillow, which TensorBoard itself depends on);
`render_comparison_text` / `render_comparison_png` / `comparison_image_tensor` draw a predicted and a measured
timeline one above the other. The trainer's report (`pipeline_report`) and the benchmark (`bench.pipeline
--timeline`) draw with them; the engine only predicts and measures.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from PIL import Image, ImageDraw, ImageFont

from gpipe_tf.gpipe.timeline import BACKWARD, FORWARD, TRANSFER, WEIGHT, Cell, Timeline, check_positive
from gpipe_tf.hyperparams import ParamsError

__all__ = ["PictureLayout", "render_text", "render_png", "image_tensor", "picture_layout", "title", "cell_color",
           "render_comparison_text", "render_comparison_png", "comparison_layout", "comparison_image_tensor",
           "FORWARD_COLORS", "BACKWARD_COLORS", "WEIGHT_COLORS", "TRANSFER_COLOR", "IDLE_COLOR", "GRID_COLOR",
           "TEXT_COLOR", "LIGHT_TEXT_COLOR"]


# Two shades per phase, alternating with the micro-batch parity, so neighbouring cells stay distinguishable
# even where a grid line is hard to see in a downscaled summary image. Later laps (interleaved, V) darken these
# shades (`cell_color`); transfers of measured timelines get a third hue.
FORWARD_COLORS = ((110, 160, 230), (150, 190, 245))
BACKWARD_COLORS = ((235, 140, 80), (245, 180, 125))
WEIGHT_COLORS = ((175, 125, 215), (205, 170, 235))  # weight gradients, where an order splits them off (W)
TRANSFER_COLOR = (140, 200, 140)
IDLE_COLOR = (255, 255, 255)
GRID_COLOR = (205, 205, 205)
TEXT_COLOR = (25, 25, 25)
LIGHT_TEXT_COLOR = (250, 250, 250)  # digits on dark (late-lap) cells; not pure white, which means idle
_LAP_DARKENING = 0.45  # the last lap's shade: this fraction darker than lap 0's
_DARK_LUMINANCE = 120  # cells darker than this get light digits

# A pathological cost spread (e.g. 1e-6 next to 1.0) would otherwise make a default-tick picture millions of
# columns wide; the default tick is coarsened to stay under this, an explicit one is refused above it.
_MAX_COLUMNS = 4096
_MAX_PIXELS = 64 * 1024 * 1024
# The picture: the grid scaled to about this many pixels wide by default, never more than _AUTO_MAX_PIXELS (a
# summary image TensorBoard shows at once); text sizes in pixels; the margin between parts.
_TARGET_WIDTH = 1200
_AUTO_MAX_PIXELS = 16 * 1024 * 1024
# A predicted picture drawn at the default cell size is never wider than this: TensorBoard shows an image at
# about this width, so a longer grid wraps into bands of rows, one below the other, each holding the next
# columns (measured: an interleaved K=4 M=16 v=4 grid drawn in one band was 4368 px wide). Its default tick is
# coarsened so that it has at most _MAX_WRAPPED_COLUMNS columns (a few bands), a cell shorter than the tick
# still taking one column of its own (`_show_hidden_cells`).
_MAX_PICTURE_WIDTH = 1300
_MAX_WRAPPED_COLUMNS = 400
_HIDDEN_CELL_REACH = 2
_TITLE_PX = 20
_LABEL_PX = 16
_PAD = 10
_MIN_TICK_LABEL_PX = 80  # measured pictures: at least this many pixels between two millisecond labels

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
_GLYPH_MASKS = {d: np.array([[ch == "#" for ch in row] for row in rows], dtype=bool) for d, rows in _GLYPHS.items()}

def _check_timeline(timeline: object, name: str = "timeline") -> Timeline:
    if not isinstance(timeline, Timeline):
        raise ParamsError(f"{name}={timeline!r} is invalid: pass the Timeline returned by predict(...) or "
                          "Timeline.measured(...)")
    return timeline


def _resolve_tick(timeline: Timeline, tick: float | None) -> tuple[float, int]:
    """(tick, number of columns) for drawing `timeline`; the default tick is the shortest forward or backward
    cell's duration (transfers, often far shorter, would make the picture needlessly wide)."""
    if tick is None:
        durations = [c.duration for c in timeline.cells if c.phase != TRANSFER and c.duration > 0]
        tick = min(durations or [c.duration for c in timeline.cells if c.duration > 0])
        tick = max(tick, timeline.makespan / _MAX_COLUMNS)
    else:
        tick = check_positive("tick", tick, "the time one column stands for")
        if timeline.makespan / tick > _MAX_COLUMNS:
            raise ParamsError(f"tick={tick!r} would draw {math.ceil(timeline.makespan / tick)} columns (at most "
                              f"{_MAX_COLUMNS}): use tick >= {timeline.makespan / _MAX_COLUMNS:.6g} or None")
    # The epsilon keeps a makespan that is a whole number of ticks, up to rounding, from gaining an empty column.
    return tick, max(1, math.ceil(timeline.makespan / tick - 1e-9))


def _drawing_priority(cell: Cell) -> tuple[bool, float]:
    """Where measured cells overlap, compute shows over a transfer, and the latest-started cell over the rest."""
    return cell.phase != TRANSFER, cell.start


def _grid(timeline: Timeline, tick: float, columns: int, show_hidden: bool = False) -> list[list[Cell | None]]:
    """grid[row][column]: the cell running at the middle of that column, or None when the row is idle.

    Sampling the midpoint shows every cell at least once when tick <= its duration, since any interval of one
    tick's length holds exactly one midpoint. Measured cells of a row may overlap, so one may hide another, and a
    coarse tick (`show_hidden`) skips short cells; a forward or backward left without a column then takes one it
    overlaps (`_show_hidden_cells`).
    """
    rows: list[list[Cell | None]] = []
    for k in range(timeline.num_stages):
        row: list[Cell | None] = []
        stage_cells = timeline.stage_cells(k)
        pos = 0
        running: list[Cell] = []
        for j in range(columns):
            mid = (j + 0.5) * tick
            while pos < len(stage_cells) and stage_cells[pos].start <= mid:
                running.append(stage_cells[pos])
                pos += 1
            running = [c for c in running if c.end > mid]
            row.append(max(running, key=_drawing_priority) if running else None)
        if timeline.is_measured or show_hidden:
            _show_hidden_cells(row, stage_cells, tick)
        rows.append(row)
    return rows


def _show_hidden_cells(row: list[Cell | None], cells: list[Cell], tick: float) -> None:
    """Gives each forward or backward of `cells` that `row` does not show one column it overlaps, taken from an
    idle column, a transfer or a cell that `row` shows in other columns too (the one nearest the cell's middle).
    Where every column it overlaps is taken (two cells far shorter than a tick at one instant), the nearest such
    column up to _HIDDEN_CELL_REACH columns away."""
    shown = collections.Counter(id(c) for c in row if c is not None)
    for cell in cells:
        if cell.phase == TRANSFER or shown[id(cell)]:
            continue
        first = min(len(row) - 1, int(cell.start // tick))
        last = max(first, min(len(row) - 1, math.ceil(cell.end / tick) - 1))
        free: list[int] = []
        for reach in range(_HIDDEN_CELL_REACH + 1):
            free = [j for j in range(max(0, first - reach), min(len(row), last + reach + 1))
                    if row[j] is None or row[j].phase == TRANSFER or shown[id(row[j])] > 1]
            if free:
                break
        if free:
            j = min(free, key=lambda j: abs((j + 0.5) * tick - (cell.start + cell.end) / 2))
            if row[j] is not None:
                shown[id(row[j])] -= 1
            row[j] = cell
            shown[id(cell)] += 1


def _lap_letters(lap: int) -> str:
    """a, b, ..., z, aa, ab, ...: the text label of a lap."""
    letters = ""
    while True:
        letters = chr(ord("a") + lap % 26) + letters
        lap = lap // 26 - 1
        if lap < 0:
            return letters


def _row_word(timeline: Timeline) -> str:
    return "device" if timeline.virtual_stages > 1 else "stage"


def _text_heading(timeline: Timeline, prefix: str) -> str:
    t = timeline
    bubble = f"bubble {t.bubble_fraction:.1%} (bound {t.ideal_bubble_fraction():.1%})"
    if not t.is_measured:
        return f"{prefix}GPipe schedule {t.schedule_label()} K={t.num_stages} M={t.num_micro_batches}: {bubble}"
    heading = (f"{prefix or 'measured: '}GPipe schedule {t.schedule_label()} K={t.num_stages} M={t.num_micro_batches}: "
               f"step {t.makespan * 1e3:.4g} ms, {bubble}")
    if any(c.phase == TRANSFER for c in t.cells):
        heading += f", idle {t.idle_fraction:.1%} counting transfers as busy"
    return heading


def _render_text(timeline: Timeline, tick: float | None, prefix: str) -> str:
    timeline = _check_timeline(timeline)
    tick, columns = _resolve_tick(timeline, tick)
    v = timeline.virtual_stages
    suffix_width = len(_lap_letters(v - 1)) if v > 1 else 0
    width = len(str(timeline.num_micro_batches - 1)) + suffix_width
    stage_width = len(str(timeline.num_stages - 1))
    keys = ["n = forward", "n' = backward"]
    if v > 1:
        keys.append("letter = lap (a: the device's first chunk in pipeline order, b: its second, ...)")
    if any(c.phase == WEIGHT for c in timeline.cells):
        keys.append('n" = weight gradients')
    if any(c.phase == TRANSFER for c in timeline.cells):
        keys.append("~ = transfer")
    keys.append(". = idle")
    column = f"{tick * 1e3:.3g} ms" if timeline.is_measured else f"{tick:.4g}"
    lines = [f"{_text_heading(timeline, prefix)}; 1 column = {column}, {', '.join(keys)}"]
    for k, row in enumerate(_grid(timeline, tick, columns)):
        text = []
        for c in row:
            if c is None:
                text.append(f"{'.':>{width}} ")
            elif c.phase == TRANSFER:
                text.append(f"{'~':>{width}} ")
            else:
                label = str(c.micro_batch) + (_lap_letters(c.lap) if v > 1 else "")
                text.append(f"{label:>{width}}" + {FORWARD: " ", BACKWARD: "'", WEIGHT: '"'}[c.phase])
        lines.append(f"{_row_word(timeline)} {k:>{stage_width}} |{''.join(text)}|")
    return "\n".join(lines)


def render_text(timeline: Timeline, tick: float | None = None) -> str:
    """Draws `timeline` as text: a header line, then one row per stage ("stage 0 |...|").

    Each column is one tick of time (default: the shortest forward or backward cell's duration, so every such
    cell shows at least once) and is len(str(M-1)) + 1 characters wide. A forward tick shows the micro-batch
    number followed by a space ("3 "), a backward tick the number followed by a prime ("3'", as in a derivative),
    an idle tick a dot (". "). Numbers are right-aligned so that micro-batches >= 10 stay readable ("12'" next
    to " 3'"). A cell lasting several ticks repeats its label, so widths show durations.

    The header says "GPipe schedule K=.. M=..: bubble ..% (bound ..%)" for fill-drain and names any other
    schedule after "schedule". Interleaved timelines (v > 1) have one row per device ("device 0 |...|") and a
    lap letter after each number ("3b'": backward of micro-batch 3 in the device's second chunk), columns one
    character wider.
    Measured timelines start "measured: ", give the step time and count columns in milliseconds; a transfer
    tick shows "~".

    Raises:
      ParamsError: `tick` is not a positive number or would draw more than 4096 columns.
    """
    return _render_text(timeline, tick, "")


def _check_pair(predicted: object, measured: object) -> tuple[Timeline, Timeline]:
    predicted = _check_timeline(predicted, "predicted")
    measured = _check_timeline(measured, "measured")
    if predicted.is_measured:
        raise ParamsError("predicted is a measured timeline: pass predict(...)'s timeline first, "
                          "Timeline.measured(...)'s second")
    if not measured.is_measured:
        raise ParamsError("measured is a predicted timeline: pass Timeline.measured(...)'s timeline second")
    return predicted, measured


def render_comparison_text(predicted: Timeline, measured: Timeline) -> str:
    """`render_text` of a predicted and a measured timeline, one above the other, headed "predicted: " and
    "measured: ", each at its own default tick."""
    predicted, measured = _check_pair(predicted, measured)
    return _render_text(predicted, None, "predicted: ") + "\n\n" + _render_text(measured, None, "measured: ")


def cell_color(phase: str, micro_batch: int | None, lap: int = 0, virtual_stages: int = 1) -> tuple[int, int, int]:
    """The fill color of a cell: blue forward, orange backward, purple weight gradients, in two shades
    alternating with the micro-batch's parity; lap l of v darker by 0.45 * l / (v-1) (lap 0 keeps the plain
    shades); a transfer green."""
    if phase == TRANSFER:
        return TRANSFER_COLOR
    base = {FORWARD: FORWARD_COLORS, BACKWARD: BACKWARD_COLORS, WEIGHT: WEIGHT_COLORS}[phase][(micro_batch or 0) % 2]
    if virtual_stages <= 1 or lap == 0:
        return base
    keep = 1.0 - _LAP_DARKENING * lap / (virtual_stages - 1)
    return tuple(round(x * keep) for x in base)


def _ink_for(color: tuple[int, int, int]) -> tuple[int, int, int]:
    luminance = 0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2]
    return LIGHT_TEXT_COLOR if luminance < _DARK_LUMINANCE else TEXT_COLOR


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


def _grid_picture(timeline: Timeline, cell_px: int, rows: list[list[Cell | None]]) -> np.ndarray:
    """The cells of `rows` (a `_grid`, or some of its columns) alone as a uint8
    [K * cell_px + 1, columns * cell_px + 1, 3] array, grid lines included."""
    # About 60% of the row height for digits: readable, with room left for the grid and margins.
    max_scale = max(1, (cell_px * 3 // 5) // 5)
    columns = len(rows[0])
    height = timeline.num_stages * cell_px + 1
    width = columns * cell_px + 1
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = IDLE_COLOR
    image[::cell_px, :] = GRID_COLOR
    image[:, ::cell_px] = GRID_COLOR
    for k, row in enumerate(rows):
        top = k * cell_px
        j = 0
        while j < columns:
            c = row[j]
            end = j + 1
            while end < columns and row[end] is c:
                end += 1
            if c is not None:
                left, right = j * cell_px, end * cell_px
                color = cell_color(c.phase, c.micro_batch, c.lap, timeline.virtual_stages)
                # Filling inside the grid lines erases the tick lines within a multi-tick cell: one block each.
                image[top + 1:top + cell_px, left + 1:right] = color
                if c.phase != TRANSFER:
                    _draw_text(image, str(c.micro_batch), top, left, cell_px + 1, right - left + 1, max_scale,
                               _ink_for(color))
            j = end
    return image


@dataclasses.dataclass(frozen=True)
class PictureLayout:
    """Where render_png puts things: the grid's top-left pixel, its cell size and column count, the image size;
    for a grid wrapped into bands, their number, the columns each holds (the last may hold fewer) and the pixels
    from one band's top to the next; and the time one column stands for."""

    cell_px: int
    columns: int
    grid_top: int
    grid_left: int
    height: int
    width: int
    bands: int = 1
    band_columns: int = 0
    band_step: int = 0
    tick: float = 0.0


# What _font returns: Pillow's scalable font, or its bitmap font where FreeType is missing.
_Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


def _font(size: int) -> _Font:
    try:
        return ImageFont.load_default(size=size)  # Pillow's built-in scalable font (needs FreeType)
    except (TypeError, ValueError, OSError, ImportError):
        return ImageFont.load_default()  # a fixed bitmap font: smaller, still legible


def _summary(timeline: Timeline, schedule: str | None) -> str:
    t = timeline
    name = t.schedule_label() if schedule is None else schedule
    if t.virtual_stages > 1 and "v=" not in name:
        name += f" v={t.virtual_stages}"
    rows = "stages" if t.virtual_stages == 1 else f"devices x {t.virtual_stages} chunks"
    text = f"{name}: K={t.num_stages} {rows}, M={t.num_micro_batches} micro-batches, "
    if t.is_measured:
        text += f"step {t.makespan * 1e3:.4g} ms, "
    text += f"bubble {t.bubble_fraction:.1%} (bound {t.ideal_bubble_fraction():.1%})"
    if t.is_measured and any(c.phase == TRANSFER for c in t.cells):
        text += f", idle {t.idle_fraction:.1%} counting transfers as busy"
    return text


def title(timeline: Timeline, schedule: str | None = None) -> str:
    """The picture's title: schedule, K, M and the bubble fraction against the schedule's bound.

    `schedule` names the schedule in place of the timeline's own name (e.g. the class that runs it, "FillDrain");
    v is added for the interleaved schedule. A measured timeline's title starts "measured: " and gives the step
    time in milliseconds.
    """
    timeline = _check_timeline(timeline)
    return ("measured: " if timeline.is_measured else "") + f"GPipe schedule {_summary(timeline, schedule)}"


def _legend(timelines: list[Timeline]) -> list[tuple[list[tuple[int, int, int]], str]]:
    """(swatch colors, text) per legend entry, covering what any of `timelines` shows."""
    v = max(t.virtual_stages for t in timelines)
    forward = "forward of micro-batch n"
    if v > 1:
        forward += f", laps a..{_lap_letters(v - 1)} light to dark"
    backward = "backward of n" + (" (recomputes its forward)" if any(any(t.remat or ()) for t in timelines) else "")
    entries = [([cell_color(FORWARD, 0, c, v) for c in range(v)], forward),
               ([cell_color(BACKWARD, 0, c, v) for c in range(v)], backward)]
    if any(c.phase == WEIGHT for t in timelines for c in t.cells):
        backward = backward.replace("backward of n", "input gradient of n")
        entries[1] = (entries[1][0], backward)
        entries.append(([cell_color(WEIGHT, 0, c, v) for c in range(v)], "weight gradients of n"))
    if any(c.phase == TRANSFER for t in timelines for c in t.cells):
        entries.append(([TRANSFER_COLOR], "transfer"))
    entries.append(([IDLE_COLOR], "idle (the bubble)"))
    return entries


def _nice_step(minimum: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is >= minimum (> 0)."""
    power = 10.0 ** math.floor(math.log10(minimum))
    for multiple in (1, 2, 5, 10):
        if multiple * power >= minimum * (1 - 1e-9):
            return multiple * power
    return 10 * power


def _compose(panels: list[tuple[Timeline, str]], cell_px: int | None) -> tuple[np.ndarray, list[PictureLayout]]:
    """The picture of one or more timelines, one above the other (each: title, row axis, grid, time axis), with
    one legend at the bottom; and where each grid lies. See render_png."""
    if cell_px is not None:
        cell_px = _check_cell_px(cell_px)
    title_font, label_font = _font(_TITLE_PX), _font(_LABEL_PX)
    scratch = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def size(text: str, font: _Font) -> tuple[int, int]:
        box = scratch.textbbox((0, 0), text, font=font)
        return box[2] - box[0], box[3]

    axis_w = max(max(size(_row_word(t), label_font)[0], max(size(str(k), label_font)[0] for k in range(t.num_stages)))
                 for t, _ in panels) + 2 * _PAD
    grids = []
    for timeline, _ in panels:
        tick, columns = _resolve_tick(timeline, None)
        # Measured pictures (and an explicit cell_px) keep one band: their millisecond axis runs under it.
        wrap = cell_px is None and not timeline.is_measured
        if wrap and columns > _MAX_WRAPPED_COLUMNS:
            tick = timeline.makespan / _MAX_WRAPPED_COLUMNS
            columns = max(1, math.ceil(timeline.makespan / tick - 1e-9))
        px = _auto_cell_px(timeline.num_stages, columns) if cell_px is None else cell_px
        band_h = timeline.num_stages * px + 1
        bands = math.ceil(columns * px / max(px, _MAX_PICTURE_WIDTH - axis_w - _PAD - 1)) if wrap else 1
        band_columns = math.ceil(columns / bands)
        grid_h, grid_w = bands * band_h + (bands - 1) * _PAD, band_columns * px + 1
        if grid_h * grid_w > _MAX_PIXELS:
            raise ParamsError(f"cell_px={px} would draw a {grid_w}x{grid_h} grid (more than {_MAX_PIXELS} "
                              "pixels): use a smaller cell_px")
        grids.append((tick, columns, px, grid_h, grid_w, bands, band_columns))
    legend = _legend([t for t, _ in panels])
    swatch = _LABEL_PX
    legend_w = sum(len(colors) * swatch + _PAD + size(text, label_font)[0] + 3 * _PAD for colors, text in legend)
    label_h = size("stage 0", label_font)[1]
    grid_left = axis_w
    # Rows of each panel: title, row-axis heading, grid, millisecond labels (measured only), time axis.
    tops, y, width = [], 0, _PAD + legend_w
    for (timeline, heading), (_, _, _, grid_h, grid_w, _, _) in zip(panels, grids):
        grid_top = y + _PAD + size(heading, title_font)[1] + _PAD + label_h + _PAD // 2
        time_top = grid_top + grid_h + _PAD // 2
        if timeline.is_measured:
            time_top += label_h + _PAD // 2
        tops.append((y, grid_top, time_top))
        y = time_top + label_h + _PAD
        width = max(width, grid_left + grid_w + _PAD, _PAD + size(heading, title_font)[0] + _PAD)
    legend_top = y
    height = legend_top + swatch + _PAD

    canvas = Image.new("RGB", (width, height), IDLE_COLOR)
    draw = ImageDraw.Draw(canvas)
    layouts = []
    for (timeline, heading), grid, (top, grid_top, time_top) in zip(panels, grids, tops):
        tick, columns, px, grid_h, grid_w, bands, band_columns = grid
        rows = _grid(timeline, tick, columns, show_hidden=True)
        band_step = timeline.num_stages * px + 1 + _PAD
        for b in range(bands):
            band_top = grid_top + b * band_step
            part = [row[b * band_columns:(b + 1) * band_columns] for row in rows]
            canvas.paste(Image.fromarray(_grid_picture(timeline, px, part)), (grid_left, band_top))
            for k in range(timeline.num_stages):
                w, h = size(str(k), label_font)
                draw.text((grid_left - _PAD - w, band_top + k * px + (px - h) // 2), str(k), fill=TEXT_COLOR,
                          font=label_font)
        draw.text((_PAD, top + _PAD), heading, fill=TEXT_COLOR, font=title_font)
        draw.text((_PAD, grid_top - label_h - _PAD // 2), _row_word(timeline), fill=TEXT_COLOR, font=label_font)
        if timeline.is_measured:
            _draw_milliseconds(draw, size, label_font, timeline, tick, columns, px, grid_left, grid_top + grid_h,
                               width)
            axis = f"time (ms) ->   (1 column = {tick * 1e3:.3g} ms)"
        else:
            axis = f"time ->   (1 column = {tick:.3g} forward-cost units)"
        draw.text((grid_left, time_top), axis, fill=TEXT_COLOR, font=label_font)
        layouts.append(PictureLayout(cell_px=px, columns=columns, grid_top=grid_top, grid_left=grid_left,
                                     height=height, width=width, bands=bands, band_columns=band_columns,
                                     band_step=band_step, tick=tick))
    x = _PAD
    for colors, text in legend:
        for j, color in enumerate(colors):
            draw.rectangle([x + j * swatch, legend_top, x + (j + 1) * swatch, legend_top + swatch], fill=color,
                           outline=GRID_COLOR)
        x += len(colors) * swatch
        draw.text((x + _PAD, legend_top), text, fill=TEXT_COLOR, font=label_font)
        x += _PAD + size(text, label_font)[0] + 3 * _PAD
    return np.asarray(canvas, dtype=np.uint8), layouts


def _draw_milliseconds(draw: ImageDraw.ImageDraw, size: Callable[[str, _Font], tuple[int, int]], font: _Font,
                       timeline: Timeline, tick: float, columns: int, cell_px: int, grid_left: int, grid_bottom: int,
                       width: int) -> None:
    """Tick marks and millisecond labels under a measured grid, at round times at least 80 pixels apart."""
    px_per_ms = cell_px / (tick * 1e3)
    step = _nice_step(_MIN_TICK_LABEL_PX / px_per_ms)
    n = 0
    while n * step <= columns * tick * 1e3 + 1e-9:
        x = grid_left + round(n * step * px_per_ms)
        text = f"{round(n * step, 9):g}"
        w, _ = size(text, font)
        if x + w // 2 + 1 < width:
            draw.line([x, grid_bottom, x, grid_bottom + _PAD // 2 - 1], fill=TEXT_COLOR)
            draw.text((x - w // 2, grid_bottom + _PAD // 2), text, fill=TEXT_COLOR, font=font)
        n += 1


def picture_layout(timeline: Timeline, cell_px: int | None = None, schedule: str | None = None) -> PictureLayout:
    """Where render_png(timeline, cell_px, schedule) draws the grid, and the picture's size."""
    return _compose([(_check_timeline(timeline), title(timeline, schedule))], cell_px)[1][0]


def render_png(timeline: Timeline, cell_px: int | None = None, schedule: str | None = None) -> bytes:
    """Draws `timeline` as a PNG and returns its bytes.

    On top, a title with the schedule's name (`schedule`, default the timeline's), K, M and the bubble fraction
    next to the schedule's bound. Below it the grid: rows are stages (devices when interleaved; labelled on the
    left under a "stage" or "device" heading), columns time ticks of the shortest forward or backward cell's
    duration, each cell_px pixels (None: chosen so that the grid is about 1200 pixels wide, 16 to 48 pixels a
    cell); a time arrow under the grid and a legend at the bottom. Forward cells are blue, backward orange, in
    two shades alternating with the micro-batch parity, darker for later laps (`cell_color`);
    transfers green; idle ticks white, grid lines light gray. Each compute cell is one block with its
    micro-batch number drawn in a 3x5 bitmap font scaled to fit; the other text uses Pillow's built-in font.
    A measured timeline has millisecond labels under its grid. `picture_layout` says where the grid is.

    Raises:
      ParamsError: `cell_px` is not None or an int in [8, 256], or the picture would be too large.
    """
    return tf.io.encode_png(_compose([(_check_timeline(timeline), title(timeline, schedule))], cell_px)[0]).numpy()


def image_tensor(timeline: Timeline, cell_px: int | None = None, schedule: str | None = None) -> tf.Tensor:
    """The render_png picture as a [1, H, W, 3] uint8 tensor, ready for `tf.summary.image`."""
    picture = _compose([(_check_timeline(timeline), title(timeline, schedule))], cell_px)[0]
    return tf.convert_to_tensor(picture[np.newaxis])


def _comparison_panels(predicted: Timeline, measured: Timeline, schedule: str | None) -> list[tuple[Timeline, str]]:
    predicted, measured = _check_pair(predicted, measured)
    return [(predicted, f"predicted: {_summary(predicted, schedule)}"),
            (measured, f"measured: {_summary(measured, schedule)}")]


def comparison_layout(predicted: Timeline, measured: Timeline, cell_px: int | None = None,
                      schedule: str | None = None) -> tuple[PictureLayout, PictureLayout]:
    """Where render_comparison_png draws the predicted grid and the measured grid, and the picture's size."""
    first, second = _compose(_comparison_panels(predicted, measured, schedule), cell_px)[1]
    return first, second


def render_comparison_png(predicted: Timeline, measured: Timeline, cell_px: int | None = None,
                          schedule: str | None = None) -> bytes:
    """A PNG of a predicted timeline above a measured one, each with its own title ("predicted: ... bubble x%
    (bound y%)", "measured: ... step t ms, bubble x% (bound y%)"), row axis and time axis (forward-cost units
    above, milliseconds below), and one legend at the bottom; otherwise drawn as render_png draws each.

    Raises:
      ParamsError: the first is not a predicted timeline or the second not a measured one, or as render_png.
    """
    return tf.io.encode_png(_compose(_comparison_panels(predicted, measured, schedule), cell_px)[0]).numpy()


def comparison_image_tensor(predicted: Timeline, measured: Timeline, cell_px: int | None = None,
                            schedule: str | None = None) -> tf.Tensor:
    """The render_comparison_png picture as a [1, H, W, 3] uint8 tensor, ready for `tf.summary.image`."""
    picture = _compose(_comparison_panels(predicted, measured, schedule), cell_px)[0]
    return tf.convert_to_tensor(picture[np.newaxis])
