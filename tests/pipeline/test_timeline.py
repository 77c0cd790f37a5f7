"""Pipeline timelines: the predicted fill-drain, 1F1B, interleaved and zero-bubble schedules (bubble, order,
dependencies, remat costs, in-flight micro-batches), measured timelines, and their text and PNG pictures."""

import dataclasses
import itertools
import re
from fractions import Fraction

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.gpipe import orders, timeline
from gpipe_tf.gpipe.plan import StagePlan
from gpipe_tf.gpipe.schedules import schedule_params
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.memory.stash import stashed_micro_batches
from gpipe_tf.training import pipeline_report
from gpipe_tf.training import timeline_pictures as pictures


def order(schedule="fill_drain", k=2, v=None):
    """The order data of the schedule a short name stands for (v: Interleaved's virtual_stages), on K devices."""
    p = schedule_params(schedule)
    if v is not None and (schedule == "interleaved" or v != 1):
        p.set(virtual_stages=v)
    return p.instantiate().step_order(k)


def predict(num_stages, num_micro_batches, *args, schedule="fill_drain", virtual_stages=None, **kwargs):
    """timeline.predict of the named schedule's order on K devices (fill-drain: K itself, which predict checks)."""
    if schedule == "fill_drain" and virtual_stages in (None, 1):
        return timeline.predict(num_stages, num_micro_batches, *args, **kwargs)
    return timeline.predict(order(schedule, num_stages, virtual_stages), num_micro_batches, *args, **kwargs)


@pytest.mark.parametrize("ratio", [2.0, 1.0, 3.5])
def test_equal_costs_reach_gpipe_bound_exactly(ratio):
    for k, m in itertools.product([1, 2, 3, 4, 7], [1, 2, 4, 5, 16, 33]):
        t = predict(k, m, backward_ratio=ratio)
        bound = Fraction(k - 1, m + k - 1)
        assert t.bubble_fraction == pytest.approx(float(bound), abs=1e-12), (k, m)
        assert t.ideal_bubble_fraction() == pytest.approx(float(bound), abs=1e-12)
        # Fill and drain each take K-1 extra steps: forwards end at M+K-1, backwards take ratio times as long.
        assert t.makespan == pytest.approx((1 + ratio) * (m + k - 1), rel=1e-12)
        assert len(t.cells) == 2 * k * m


def _check_dependencies(t):
    k_stages, m = t.num_stages, t.num_micro_batches
    f = {(c.stage, c.micro_batch): c for c in t.cells if c.phase == "F"}
    b = {(c.stage, c.micro_batch): c for c in t.cells if c.phase == "B"}
    assert len(f) == len(b) == k_stages * m
    for k in range(k_stages):
        last_forward = max(f[k, i].end for i in range(m))
        # GPipe order on a stage, one cell at a time: F 0..M-1 then B M-1..0.
        order = [f[k, i] for i in range(m)] + [b[k, i] for i in reversed(range(m))]
        assert t.stage_cells(k) == order
        for prev, nxt in zip(order, order[1:]):
            assert nxt.start >= prev.end - 1e-12
        for i in range(m):
            if k > 0:
                assert f[k, i].start >= f[k - 1, i].end - 1e-12
            assert b[k, i].start >= last_forward - 1e-12
            upstream = b[k + 1, i] if k < k_stages - 1 else f[k, i]
            assert b[k, i].start >= upstream.end - 1e-12
    assert t.makespan == max(c.end for c in t.cells)


@pytest.mark.parametrize("k,m,costs,remat", [
    (1, 3, None, False),
    (4, 6, None, False),
    (3, 5, [1.0, 2.5, 0.5], False),
    (4, 8, [2.0, 1.0, 1.0, 3.0], [True, False, True, False]),
    (5, 2, [0.3, 0.1, 0.7, 0.2, 0.4], True),
])
def test_every_cell_respects_its_dependencies(k, m, costs, remat):
    t = predict(k, m, costs, remat=remat)
    _check_dependencies(t)
    # The simulation starts each cell as early as allowed: the first forward on stage 0 at time 0 and no
    # cell later than its latest dependency or its stage's previous cell.
    assert t.cell(0, 0, "F").start == 0.0


def test_forward_clock_tick_is_i_plus_k_for_equal_costs():
    t = predict(3, 4)
    for c in t.cells:
        if c.phase == "F":
            assert c.start == c.micro_batch + c.stage


def test_unbalanced_stages_match_hand_computation():
    t = predict(2, 4, [1, 3])
    # Stage 1 (cost 3) bottlenecks: its forwards run 1-4, 4-7, 7-10, 10-13; its backwards (cost 6) 13-19, ..,
    # 31-37; stage 0's last backward (cost 2) follows at 37-39. Busy 12 + 36 of 2 * 39.
    assert t.makespan == pytest.approx(39.0)
    assert [(c.start, c.end) for c in t.stage_cells(1)] == [
        (1, 4), (4, 7), (7, 10), (10, 13), (13, 19), (19, 25), (25, 31), (31, 37)]
    assert t.cell(0, 3, "B").start == pytest.approx(19.0)
    assert t.bubble_fraction == pytest.approx(1 - 48 / 78, abs=1e-12)
    assert t.bubble_fraction > t.ideal_bubble_fraction() + 0.1


def test_remat_adds_one_forward_to_each_backward():
    costs = [1.0, 2.0, 0.5]
    plain = predict(3, 4, costs)
    everywhere = predict(3, 4, costs, remat=True)
    some = predict(3, 4, costs, backward_ratio=1.5, remat=[True, False, True])
    for c in plain.cells:
        assert c.end - c.start == pytest.approx(costs[c.stage] * (2.0 if c.phase == "B" else 1.0))
    for c in everywhere.cells:
        assert c.end - c.start == pytest.approx(costs[c.stage] * (3.0 if c.phase == "B" else 1.0))
    for c in some.cells:
        factor = 1.0 if c.phase == "F" else 1.5 + (1.0 if c.stage != 1 else 0.0)
        assert c.end - c.start == pytest.approx(costs[c.stage] * factor)
    assert everywhere.makespan > plain.makespan
    # Uniform remat scales every backward alike, so equal stages keep the GPipe bound.
    assert predict(4, 6, remat=True).bubble_fraction == pytest.approx(3 / 9, abs=1e-12)
    _check_dependencies(some)


def _text_rows(text, k, m):
    lines = text.split("\n")
    assert len(lines) == 1 + k
    width = len(str(m - 1)) + 1
    rows = []
    for stage, line in enumerate(lines[1:]):
        match = re.fullmatch(r"stage +(\d+) \|(.*)\|", line)
        assert match and int(match.group(1)) == stage, line
        body = match.group(2)
        assert len(body) % width == 0
        rows.append([body[j:j + width] for j in range(0, len(body), width)])
    return lines[0], rows


def test_text_header_rows_and_both_phases_of_every_micro_batch():
    header, rows = _text_rows(pictures.render_text(predict(2, 4)), 2, 4)
    assert header.startswith("GPipe schedule fill_drain K=2 M=4: bubble 20.0% (bound 20.0%)")
    assert rows[0] == ["0 ", "1 ", "2 ", "3 ", ". ", ". ", ". ", "3'", "3'", "2'", "2'", "1'", "1'", "0'", "0'"]
    assert rows[1] == [". ", "0 ", "1 ", "2 ", "3 ", "3'", "3'", "2'", "2'", "1'", "1'", "0'", "0'", ". ", ". "]


def test_text_keeps_two_digit_micro_batches_readable():
    k, m = 3, 12
    _, rows = _text_rows(pictures.render_text(predict(k, m, [1, 2, 1])), k, m)
    for row in rows:
        forward = {int(c) for c in row if c.endswith(" ") and c.strip() != "."}
        backward = {int(c[:-1]) for c in row if c.endswith("'")}
        assert forward == backward == set(range(m))
        assert all(c.strip() == "." or c.strip(" '").isdigit() for c in row)
    # The default tick is the shortest cell (1): stage 1's forwards (cost 2) span two columns each.
    assert rows[1][1:5] == [" 0 ", " 0 ", " 1 ", " 1 "]


def test_text_coarser_tick_halves_the_columns():
    t = predict(2, 4)
    _, fine = _text_rows(pictures.render_text(t), 2, 4)
    _, coarse = _text_rows(pictures.render_text(t, tick=2.0), 2, 4)
    assert len(fine[0]) == 15 and len(coarse[0]) == 8
    # Each column shows what runs at its middle (times 1, 3, 5, ...): short forwards may drop out, e.g. F(1, 1).
    assert coarse[1] == ["0 ", "2 ", "3'", "2'", "1'", "0'", ". ", ". "]


def _decoded(png):
    return tf.io.decode_png(png, channels=3).numpy()


def _count_color(image, color):
    return int(np.all(image == np.array(color, dtype=np.uint8), axis=-1).sum())


def _ink(image, color):
    return np.all(image == np.array(color, dtype=np.uint8), axis=-1)


def test_png_grid_size_colors_and_place():
    k, m, px = 3, 5, 20
    t = predict(k, m)
    image = _decoded(pictures.render_png(t, cell_px=px))
    layout = pictures.picture_layout(t, cell_px=px)
    columns = 3 * (m + k - 1)  # makespan / shortest cell (forward, 1.0)
    assert (layout.cell_px, layout.columns) == (px, columns)
    assert image.shape == (layout.height, layout.width, 3)
    top, left = layout.grid_top, layout.grid_left
    grid = image[top:top + k * px + 1, left:left + columns * px + 1]
    # The grid is closed by gray lines on all four sides.
    for edge in (grid[0], grid[-1], grid[:, 0], grid[:, -1]):
        assert _ink(edge, pictures.GRID_COLOR).all()
    for colors in (pictures.FORWARD_COLORS, pictures.BACKWARD_COLORS):
        for color in colors:
            assert _count_color(grid, color) > 0
    assert _count_color(grid, pictures.IDLE_COLOR) > 0
    assert _count_color(grid, pictures.TEXT_COLOR) > 0
    # F(0, 0) is the first column of row 0; stage 1 idles there during the fill.
    assert tuple(grid[3, 3]) == pictures.FORWARD_COLORS[0]
    assert tuple(grid[px + 3, 3]) == pictures.IDLE_COLOR
    # The last column of stage 0 is the second tick of B(0, 0).
    assert tuple(grid[3, -4]) == pictures.BACKWARD_COLORS[0]


def test_png_has_title_stage_axis_and_legend():
    k, m = 2, 4
    t = predict(k, m, remat=True)
    image = _decoded(pictures.render_png(t, schedule="FillDrain"))
    layout = pictures.picture_layout(t, schedule="FillDrain")
    assert pictures.title(t, "FillDrain") == ("GPipe schedule FillDrain: K=2 stages, M=4 micro-batches, bubble 20.0% "
                                              "(bound 20.0%)")
    dark = np.all(image < 128, axis=-1)
    # Title (text above the grid), stage numbers (left of each row) and the time axis and legend (below it).
    assert dark[:layout.grid_top - 20].any()
    for stage in range(k):
        row = slice(layout.grid_top + stage * layout.cell_px + 2, layout.grid_top + (stage + 1) * layout.cell_px - 1)
        assert dark[row, :layout.grid_left].any(), stage
    below = image[layout.grid_top + k * layout.cell_px + 2:]
    assert np.all(below < 128, axis=-1).any()
    # The legend's swatches: a forward and a backward color block below the grid.
    assert _count_color(below, pictures.FORWARD_COLORS[0]) >= 100
    assert _count_color(below, pictures.BACKWARD_COLORS[0]) >= 100


def test_default_picture_is_scaled_up_to_a_readable_size():
    # The 2-stage toy pipeline's timeline: the summary image used to be a 625x49 strip.
    t = predict(2, 4, [0.53, 0.47], remat=True)
    image = _decoded(pictures.render_png(t))
    layout = pictures.picture_layout(t)
    assert layout.cell_px >= 32 and image.shape[1] >= 1000 and image.shape[0] >= 2 * layout.cell_px + 100
    # Deep pipelines get smaller cells, and the picture stays bounded.
    deep = pictures.picture_layout(predict(128, 32))
    assert 8 <= deep.cell_px <= 16 and deep.height * deep.width <= 20 * 1024 * 1024


# The toy pipeline's stage costs by parameter count: dropout stages have none (a cell ~1e-12 long).
_BLOBS_COSTS = [1088, 0, 4160, 0, 4160, 0]


@pytest.mark.parametrize("schedule, k, m, v, costs", [
    ("fill_drain", 4, 6, 1, None), ("fill_drain", 8, 32, 1, None), ("one_f_one_b", 2, 4, 1, None),
    ("one_f_one_b", 4, 32, 1, None), ("interleaved", 2, 4, 2, None), ("interleaved", 4, 16, 4, None),
    ("interleaved", 2, 4, 3, _BLOBS_COSTS), ("fill_drain", 2, 4, 1, _BLOBS_COSTS[:2] + [0.0, 5.0]),
])
def test_every_schedule_picture_is_at_most_1300_pixels_wide_and_shows_every_cell(schedule, k, m, v, costs):
    # The interleaved picture of K=4 M=16 v=4 used to be 4368 px wide, the toy pipeline's 65616 px: TensorBoard
    # shrank them to an unreadable strip. A long grid now wraps into bands of rows.
    if costs is not None:
        costs = [max(c, 1e-12) / sum(costs) for c in costs]
        k_pipe = len(costs)
    else:
        k_pipe = k * v
    t = predict(k_pipe // v, m, costs, remat=True, schedule=schedule, virtual_stages=v)
    image = _decoded(pictures.render_png(t))
    layout = pictures.picture_layout(t)
    assert image.shape == (layout.height, layout.width, 3)
    assert layout.width <= 1300 and layout.cell_px >= 16, layout
    assert layout.bands * layout.band_columns >= layout.columns > (layout.bands - 1) * layout.band_columns
    # Each forward and backward cell fills with its own color one of the columns it overlaps (or, far shorter than
    # a column and at the same instant as another such cell, one up to 2 columns away).
    px, tick = layout.cell_px, layout.tick
    for cell in t.cells:
        color = np.array(pictures.cell_color(cell.phase, cell.micro_batch, cell.lap, t.virtual_stages), np.uint8)
        first = min(layout.columns - 1, int(cell.start // tick))
        last = max(first, min(layout.columns - 1, int(np.ceil(cell.end / tick)) - 1))
        if cell.duration >= tick:
            first, last = first + 2, last - 2
        found = False
        for j in range(max(0, first - 2), min(layout.columns, last + 3)):
            band, column = divmod(j, layout.band_columns)
            top = layout.grid_top + band * layout.band_step + cell.stage * px
            left = layout.grid_left + column * px
            found = found or bool(np.all(image[top + 1:top + px, left + 1:left + px] == color, axis=-1).mean() > 0.5)
        assert found, cell


def test_png_draws_micro_batch_digits_inside_cells():
    px = 24
    t = predict(1, 2, backward_ratio=1.0)  # columns: F0 F1 B1 B0
    image = _decoded(pictures.render_png(t, cell_px=px))
    layout = pictures.picture_layout(t, cell_px=px)
    ink = _ink(image, pictures.TEXT_COLOR)[layout.grid_top:, layout.grid_left:]
    cells = [ink[1:px, px * j + 1:px * (j + 1)] for j in range(4)]
    assert all(cell.any() for cell in cells)
    # Same digit, same glyph: F0 matches B0 and F1 matches B1, while 0 and 1 differ.
    assert np.array_equal(cells[0], cells[3]) and np.array_equal(cells[1], cells[2])
    assert not np.array_equal(cells[0], cells[1])


def test_image_tensor_for_summaries():
    t = predict(2, 3)
    tensor = pictures.image_tensor(t, cell_px=16)
    layout = pictures.picture_layout(t, cell_px=16)
    assert tensor.dtype == tf.uint8
    assert tensor.shape == (1, layout.height, layout.width, 3)
    np.testing.assert_array_equal(tensor.numpy()[0], _decoded(pictures.render_png(t, cell_px=16)))


@pytest.mark.parametrize("kwargs,names", [
    (dict(num_stages=0, num_micro_batches=4), "num_stages=0"),
    (dict(num_stages=2.0, num_micro_batches=4), "num_stages=2.0"),
    (dict(num_stages=2, num_micro_batches=-1), "num_micro_batches=-1"),
    (dict(num_stages=2, num_micro_batches=True), "num_micro_batches=True"),
    (dict(num_stages=2, num_micro_batches=4, stage_costs=[1.0]), "stage_costs=[1.0]"),
    (dict(num_stages=2, num_micro_batches=4, stage_costs=[1.0, -2.0]), "stage_costs[1]=-2.0"),
    (dict(num_stages=2, num_micro_batches=4, stage_costs=[1.0, float("nan")]), "stage_costs[1]=nan"),
    (dict(num_stages=2, num_micro_batches=4, stage_costs="12"), "stage_costs='12'"),
    (dict(num_stages=2, num_micro_batches=4, backward_ratio=0), "backward_ratio=0"),
    (dict(num_stages=2, num_micro_batches=4, remat=[True]), "remat=[True]"),
    (dict(num_stages=2, num_micro_batches=4, remat=[True, "yes"]), "remat[1]='yes'"),
    (dict(num_stages=2, num_micro_batches=4, remat="always"), "remat='always'"),
])
def test_invalid_predict_arguments_name_the_value(kwargs, names):
    with pytest.raises(ParamsError, match=re.escape(names)):
        predict(**kwargs)


def test_invalid_render_arguments_name_the_value():
    t = predict(2, 4)
    with pytest.raises(ParamsError, match=r"tick=-1\.0"):
        pictures.render_text(t, tick=-1.0)
    with pytest.raises(ParamsError, match=r"tick=0\.001 would draw 15000 columns"):
        pictures.render_text(t, tick=0.001)
    with pytest.raises(ParamsError, match=r"cell_px=4 .*\[8, 256\]"):
        pictures.render_png(t, cell_px=4)
    with pytest.raises(ParamsError, match=r"timeline='oops'"):
        pictures.render_text("oops")


def test_default_tick_is_coarsened_for_extreme_cost_spreads():
    t = predict(2, 2, [1e-7, 1.0])
    _, rows = _text_rows(pictures.render_text(t), 2, 2)
    assert len(rows[0]) <= 4096


# --- 1F1B and interleaved schedules --------------------------------------------------------------------------

SCHEDULE_CASES = [
    ("fill_drain", 1, 3, 5, None, False),
    ("one_f_one_b", 1, 1, 3, None, False),
    ("one_f_one_b", 1, 4, 2, None, False),  # M < K: no steady phase
    ("one_f_one_b", 1, 4, 8, [2.0, 1.0, 1.0, 3.0], [True, False, True, False]),
    ("one_f_one_b", 1, 3, 7, [0.3, 1.7, 0.9], True),
    ("interleaved", 2, 2, 4, None, False),
    ("interleaved", 2, 2, 2, None, False),  # M == K: every forward is warm-up
    ("interleaved", 3, 3, 6, [0.5, 1.0, 0.2, 0.7, 0.3, 0.9, 1.1, 0.4, 0.6], False),
    ("interleaved", 2, 4, 8, None, [True, False] * 4),
    ("interleaved", 1, 2, 4, None, False),
]


def _check_schedule(t):
    """Every (pipeline stage, micro-batch) forward and backward exactly once, no overlap on a row, every
    dependency respected; returns the F and B cells keyed by (pipeline stage, micro-batch)."""
    k, m, v = t.num_stages, t.num_micro_batches, t.virtual_stages
    stages = k * v
    assert t.num_chunks == stages
    keys = [(t.chunk(c), c.micro_batch, c.phase) for c in t.cells]
    assert sorted(keys) == sorted((s, i, p) for s in range(stages) for i in range(m) for p in "FB")
    f = {(t.chunk(c), c.micro_batch): c for c in t.cells if c.phase == "F"}
    b = {(t.chunk(c), c.micro_batch): c for c in t.cells if c.phase == "B"}
    for c in t.cells:
        assert 0 <= c.stage < k and 0 <= c.lap < v
    for row in range(k):
        cells = t.stage_cells(row)
        assert {t.chunk(c) for c in cells} == {s for s in range(stages) if t.order.device(s) == row}
        for prev, nxt in zip(cells, cells[1:]):
            assert nxt.start >= prev.end - 1e-12
    for s in range(stages):
        for i in range(m):
            if s > 0:
                assert f[s, i].start >= f[s - 1, i].end - 1e-12
            upstream = b[s + 1, i] if s < stages - 1 else f[s, i]
            assert b[s, i].start >= upstream.end - 1e-12
    assert t.makespan == max(c.end for c in t.cells)
    assert min(c.start for c in t.cells) == 0.0
    return f, b


def _as_soon_as_possible(t, cells):
    """Each cell starts after every dependency of the order data (`ScheduleOrder.dependencies`: its input, its
    output gradient, the stage's previous cell of the same phase, its in-flight window, its forward waits), and
    exactly when the last of them ended or its row's previous cell ended, whichever is later: the device never
    idles while a cell could run. `cells`: every cell keyed by (phase, pipeline stage, micro-batch)."""
    m = t.num_micro_batches
    for row in range(t.num_stages):
        free = 0.0
        for c in t.stage_cells(row):
            needs = t.order.dependencies(c.phase, t.chunk(c), c.micro_batch, m)
            ready = max([cells[need].end for need in needs], default=0.0)
            assert c.start == pytest.approx(max(free, ready), abs=1e-12), c
            free = c.end


@pytest.mark.parametrize("schedule,v,k,m,costs,remat", SCHEDULE_CASES)
def test_every_schedule_runs_every_cell_once_in_dependency_order(schedule, v, k, m, costs, remat):
    t = predict(k, m, costs, remat=remat, schedule=schedule, virtual_stages=v)
    assert (t.schedule, t.virtual_stages) == (schedule, v)
    f, b = _check_schedule(t)
    _as_soon_as_possible(t, {("F", s, i): c for (s, i), c in f.items()} | {("B", s, i): c for (s, i), c in b.items()})
    # Costs: a forward stage_costs[s], a backward 2x that, plus 1x where the stage recomputes.
    stage_costs = costs or [1.0] * (k * v)
    recompute = remat if isinstance(remat, list) else [remat] * (k * v)
    for (s, _), c in f.items():
        assert c.duration == pytest.approx(stage_costs[s])
    for (s, _), c in b.items():
        assert c.duration == pytest.approx(stage_costs[s] * (3.0 if recompute[s] else 2.0))


def _expected_one_f_one_b(k, m, stage):
    w = min(k - stage - 1, m)
    order = [("F", i) for i in range(w)]
    for j in range(m - w):
        order += [("F", w + j), ("B", j)]
    return order + [("B", i) for i in range(m - w, m)]


@pytest.mark.parametrize("k,m", [(4, 8), (4, 2), (3, 3), (1, 4)])
def test_one_f_one_b_runs_warm_up_steady_and_cool_down_on_each_stage(k, m):
    t = predict(k, m, schedule="one_f_one_b")
    for stage in range(k):
        assert [(c.phase, c.micro_batch) for c in t.stage_cells(stage)] == _expected_one_f_one_b(k, m, stage)


def test_interleaved_order_follows_the_loops_windows_by_hand():
    # K=2, v=2, M=4: chunks 0a, 1a, 0b, 1b (lap l of device d is chunk 2l + d) hold at most 4, 3, 2, 1
    # micro-batches; device d's chunk a starts micro-batch i after its chunk b's forward of i - 2. Device 0 runs
    # 2a and 3a (chunk a holds 4) before its first backward 0b' is ready at 6; its backwards then follow the
    # gradients down the stages. Device 1 alternates as soon as its last stage (1b, window 1) gets going.
    t = predict(2, 4, schedule="interleaved", virtual_stages=2)
    order = [[f"{c.micro_batch}{'ab'[c.lap]}{c.phase}" for c in t.stage_cells(d)] for d in range(2)]
    assert order[0] == ["0aF", "1aF", "0bF", "1bF", "2aF", "3aF", "0bB", "2bF", "0aB", "1bB", "3bF", "1aB",
                        "2bB", "3bB", "2aB", "3aB"]
    assert order[1] == ["0aF", "1aF", "0bF", "0bB", "2aF", "1bF", "0aB", "1bB", "3aF", "2bF", "1aB", "2bB",
                        "3bF", "3bB", "2aB", "3aB"]
    # M == K: on device 0 (stages of windows 6 and 3) every forward comes first.
    t = predict(3, 3, schedule="interleaved", virtual_stages=2)
    assert [c.phase for c in t.stage_cells(0)] == ["F"] * 6 + ["B"] * 6


@pytest.mark.parametrize("ratio", [2.0, 1.0, 3.5])
def test_one_f_one_b_has_fill_drains_bubble_for_equal_stages(ratio):
    for k, m in itertools.product([1, 2, 3, 4, 7], [1, 2, 4, 5, 16]):
        t = predict(k, m, backward_ratio=ratio, schedule="one_f_one_b")
        assert t.bubble_fraction == pytest.approx(float(Fraction(k - 1, m + k - 1)), abs=1e-12), (k, m)
        assert t.ideal_bubble_fraction() == pytest.approx(float(Fraction(k - 1, m + k - 1)), abs=1e-12)
        assert t.makespan == pytest.approx((1 + ratio) * (m + k - 1), rel=1e-12)


def _max_in_flight(t, stage):
    """The most micro-batches stage `stage` holds at once: forward started, backward not yet finished."""
    f = {c.micro_batch: c for c in t.stage_cells(stage) if c.phase == "F"}
    b = {c.micro_batch: c for c in t.stage_cells(stage) if c.phase == "B"}
    times = sorted({c.start for c in f.values()})
    return max(sum(1 for i in f if f[i].start <= time < b[i].end) for time in times)


@pytest.mark.parametrize("k,m,costs", [(4, 8, None), (4, 16, [1.0, 3.0, 0.5, 2.0]), (3, 2, None), (2, 9, [2, 1])])
def test_one_f_one_b_holds_at_most_k_minus_k_micro_batches(k, m, costs):
    one_f_one_b = predict(k, m, costs, schedule="one_f_one_b")
    fill_drain = predict(k, m, costs)
    for stage in range(k):
        assert _max_in_flight(one_f_one_b, stage) == min(k - stage, m)
        assert _max_in_flight(fill_drain, stage) == m


@pytest.mark.parametrize("k,m,v,bubble", [(2, 4, 2, Fraction(1, 9)), (2, 2, 2, Fraction(1, 5)),
                                          (2, 8, 2, Fraction(1, 17)), (2, 4, 1, Fraction(1, 5))])
def test_interleaved_reaches_its_bound_at_two_devices(k, m, v, bubble):
    # Each chunk costs 1/v of a fill-drain stage, so every device does the same work as under fill-drain; with a
    # backward twice its forward the loop's order reaches (K-1)/(vM+K-1) exactly at K=2 (hand-checked: K=2, M=4,
    # v=2 drains in 13.5 = 3 * (4 + 1/2) units against fill-drain's 15).
    t = predict(k, m, [1 / v] * (k * v), 2.0, schedule="interleaved", virtual_stages=v)
    assert bubble == Fraction(k - 1, v * m + k - 1)
    assert t.bubble_fraction == pytest.approx(float(bubble), abs=1e-12)
    assert t.ideal_bubble_fraction() == pytest.approx(float(bubble), abs=1e-12)
    assert t.makespan == pytest.approx(3.0 * (m + (k - 1) / v), rel=1e-12)


@pytest.mark.parametrize("ratio", [2.0, 1.0, 3.5])
@pytest.mark.parametrize("k,m,v", [(2, 4, 2), (3, 6, 2), (4, 8, 2), (4, 4, 2), (4, 8, 3), (2, 4, 3), (3, 9, 3)])
def test_interleaved_bubble_lies_between_its_bound_and_fill_drains(ratio, k, m, v):
    # Deeper pipelines: the loop's per-stage windows (vK - s) let a device run its first chunks' forwards ahead of
    # Megatron-LM's fixed warm-up, so the bound (K-1)/(vM+K-1) is not reached; the bubble is still below
    # fill-drain's for the same work.
    t = predict(k, m, [1 / v] * (k * v), ratio, schedule="interleaved", virtual_stages=v)
    assert t.ideal_bubble_fraction() - 1e-12 <= t.bubble_fraction < predict(k, m, None, ratio).bubble_fraction


def test_interleaving_shrinks_the_bubble_of_the_same_work():
    fill_drain = predict(2, 4)
    interleaved = predict(2, 4, [0.5] * 4, schedule="interleaved", virtual_stages=2)
    assert interleaved.makespan == pytest.approx(13.5) and fill_drain.makespan == pytest.approx(15.0)
    assert interleaved.bubble_fraction < fill_drain.bubble_fraction - 0.08
    assert interleaved.ideal_bubble_fraction() < fill_drain.ideal_bubble_fraction()


@pytest.mark.parametrize("kwargs,names", [
    (dict(schedule="interleaved", virtual_stages=0), "virtual_stages=0"),
    (dict(schedule="interleaved", virtual_stages=2, num_micro_batches=5),
     "num_micro_batches=5 is not a multiple of num_stages=2: the interleaved order runs micro-batches in groups of "
     "num_stages; use num_micro_batches=4 or 6"),
    (dict(schedule="interleaved", virtual_stages=2, num_micro_batches=1), "use num_micro_batches=2 (a multiple"),
    (dict(schedule="interleaved", virtual_stages=2, stage_costs=[1.0, 1.0]),
     "stage_costs=[1.0, 1.0] has 2 entries for num_stages=2 x virtual_stages=2 = 4 chunks"),
    (dict(schedule="interleaved", virtual_stages=2, remat=[True, False]), "remat=[True, False] has 2 entries"),
])
def test_invalid_schedule_arguments_name_the_value(kwargs, names):
    args = dict(num_stages=2, num_micro_batches=4)
    args.update(kwargs)
    with pytest.raises(ParamsError, match=re.escape(names)):
        predict(**args)


@pytest.mark.parametrize("k,m", [(1, 4), (2, 8), (3, 12), (4, 16), (4, 8)])
def test_zero_bubble_v_holds_on_each_device_what_1f1b_holds_on_its_first(k, m):
    # Each window alone lets device d's two chunks hold 2K - d and d + 1 micro-batches at once, 2K + 1
    # half-stages; the V's backward waits (each chunk starts micro-batch i after the other's backward of i - K)
    # keep every device at 2K half-stages: the K whole stages of 1F1B's first device, as in the ZB-V paper.
    v = orders.zero_bubble_v(k)
    assert v.dependencies("F", 0, k, m)[-1] == ("B", 2 * k - 1, 0)
    for order, most in ((v, 2 * k), (dataclasses.replace(v, backward_waits=()), 2 * k + 1)):
        counts = stashed_micro_batches(order, m)
        held = [sum(counts[c] for c in range(2 * k) if order.device(c) == d) for d in range(k)]
        assert held == [most] * k, (order.backward_waits, held)
    assert stashed_micro_batches(orders.one_f_one_b(k), m)[0] == k
    # Batched W keeps every micro-batch's matmul operands anyway: no backward waits there.
    assert orders.with_batched_weights(v).backward_waits == ()


def test_order_data_is_checked_and_a_deadlocking_order_is_named():
    with pytest.raises(ParamsError, match=re.escape("ScheduleOrder.in_flight=(1,) is invalid: give one window >= 1 "
                                                    "per chunk (2)")):
        orders.ScheduleOrder("mine", 2, in_flight=(1,))
    with pytest.raises(ParamsError, match=re.escape("forward_waits entry (0, 5, 1) is invalid")):
        orders.ScheduleOrder("mine", 2, forward_waits=((0, 5, 1),))
    with pytest.raises(ParamsError, match=re.escape("backward_waits entry (1, 0, 0) is invalid: chunks in [0, 2) "
                                                    "and a lag >= 1")):
        orders.ScheduleOrder("mine", 2, backward_waits=((1, 0, 0),))
    # Stage 0's forward of micro-batch 1 waits for its backward of 0 (window 1), which needs the whole forward
    # pass (loss after all forwards): a circle, reported rather than hung on.
    circular = orders.ScheduleOrder("circular", 2, in_flight=(1, 1))
    with pytest.raises(ParamsError, match=r"the circular order deadlocks: cells such as .* wait on each other"):
        timeline.predict(circular, 2)


@pytest.mark.parametrize("schedule,v", [("fill_drain", 1), ("interleaved", 3), ("zero_bubble_v", 2)])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_each_pipeline_stage_is_one_chunk_of_one_device(schedule, v, k):
    o = order(schedule, k, v if schedule == "interleaved" else None)
    assert (o.num_chunks, o.virtual_stages) == (v * k, v)
    expected = [min(s, 2 * k - 1 - s) for s in range(2 * k)] if schedule == "zero_bubble_v" else [
        s % k for s in range(v * k)]
    assert list(o.devices_by_chunk) == expected
    seen = set()
    for s in range(o.num_chunks):
        assert o.chunk_at(o.device(s), o.lap(s)) == s
        seen.add((o.device(s), o.lap(s)))
    assert seen == {(d, c) for d in range(k) for c in range(v)}


def test_chunk_devices_must_give_each_device_v_stages():
    with pytest.raises(ParamsError, match=re.escape("ScheduleOrder.chunk_devices=(0, 0, 1, 2) is invalid: give the "
                                                    "device of each of the 4 chunks, each device in [0, 2) "
                                                    "holding virtual_stages=2 of them")):
        orders.ScheduleOrder("mine", 2, 2, chunk_devices=(0, 0, 1, 2))
    with pytest.raises(ParamsError, match=re.escape("chunk_devices=(0, 1) is invalid")):
        orders.ScheduleOrder("mine", 2, 2, chunk_devices=(0, 1))


@pytest.mark.parametrize("k,m,costs", [(2, 4, None), (2, 8, None), (3, 5, [1.0, 2.5, 0.5, 0.7, 1.2, 0.9]),
                                       (4, 8, None), (1, 3, None)])
def test_zero_bubble_v_turns_on_the_last_device_and_ends_on_the_first(k, m, costs):
    # ZB-V's order: 2K stages, device d holding stages d and 2K-1-d, each backward split into B and W. Every cell
    # runs once on its stage's device, after all its dependencies, as soon as the device is free; the V halves
    # the fill and the drain, so with W waiting for the bubbles the bubble is below both GPipe's bound for two
    # chunks and ZB-H1's.
    t = predict(k, m, costs, schedule="zero_bubble_v", defer_weights=True)
    stages = 2 * k
    cells = {(c.phase, t.chunk(c), c.micro_batch): c for c in t.cells}
    assert sorted(cells) == sorted((p, s, i) for s in range(stages) for i in range(m) for p in "FBW")
    assert len(cells) == len(t.cells)
    for (phase, s, i), c in cells.items():
        assert c.stage == min(s, stages - 1 - s), (phase, s, i)
    _as_soon_as_possible(t, cells)
    # The last stage's forward and the loss's backward run on device 0, right after each other.
    for i in range(m):
        assert cells["B", stages - 1, i].start >= cells["F", stages - 1, i].end - 1e-12
    if k > 1 and costs is None:
        assert t.bubble_fraction < t.ideal_bubble_fraction()
        assert t.bubble_fraction < predict(k, m, schedule="zero_bubble", defer_weights=True).bubble_fraction


def test_titles_and_text_headers_name_the_schedule():
    one_f_one_b = predict(4, 8, schedule="one_f_one_b")
    assert pictures.title(one_f_one_b) == ("GPipe schedule one_f_one_b: K=4 stages, M=8 micro-batches, bubble 27.3% "
                                           "(bound 27.3%)")
    assert pictures.render_text(one_f_one_b).startswith("GPipe schedule one_f_one_b K=4 M=8: bubble 27.3% (bound "
                                                        "27.3%); 1 column = 1, n = forward")
    interleaved = predict(2, 4, [0.5] * 4, schedule="interleaved", virtual_stages=2)
    assert pictures.title(interleaved) == ("GPipe schedule interleaved v=2: K=2 devices x 2 chunks, M=4 "
                                           "micro-batches, bubble 11.1% (bound 11.1%)")
    assert pictures.title(interleaved, "Interleaved").startswith("GPipe schedule Interleaved v=2: K=2 devices")
    assert pictures.title(predict(2, 4)) == ("GPipe schedule fill_drain: K=2 stages, M=4 micro-batches, "
                                                      "bubble 20.0% (bound 20.0%)")


def test_interleaved_text_has_device_rows_and_chunk_letters():
    t = predict(2, 4, [0.5] * 4, schedule="interleaved", virtual_stages=2)
    lines = pictures.render_text(t).split("\n")
    assert lines[0] == ("GPipe schedule interleaved v=2 K=2 M=4: bubble 11.1% (bound 11.1%); 1 column = 0.5, "
                        "n = forward, n' = backward, letter = lap (a: the device's first chunk in pipeline order, "
                        "b: its second, ...), . = idle")
    # The order of test_interleaved_order_follows_the_loops_windows_by_hand, each forward one column, each
    # backward two.
    assert lines[1] == "device 0 |0a 1a 0b 1b 2a 3a 0b'0b'2b  . 0a'0a'1b'1b'3b  . 1a'1a'2b'2b' . 3b'3b'2a'2a'3a'3a'|"
    assert lines[2] == "device 1 | . 0a 1a 0b 0b'0b'2a 1b 0a'0a'1b'1b'3a 2b 1a'1a'2b'2b'3b 3b'3b'2a'2a'3a'3a' .  . |"


def test_png_shades_interleaved_chunks():
    px = 20
    t = predict(2, 4, [0.5] * 4, schedule="interleaved", virtual_stages=2)
    image = _decoded(pictures.render_png(t, cell_px=px))
    layout = pictures.picture_layout(t, cell_px=px)
    grid = image[layout.grid_top:, layout.grid_left:]
    # Device 0 runs F 0a, 1a, 0b, 1b in its first four columns: chunk 0 in the plain shades, chunk 1 darker.
    chunk1 = [pictures.cell_color("F", i, 1, 2) for i in range(2)]
    assert [tuple(grid[3, px * j + 3]) for j in range(4)] == [*pictures.FORWARD_COLORS, *chunk1]
    for dark, light in zip(chunk1, pictures.FORWARD_COLORS):
        assert all(d < c for d, c in zip(dark, light))
    assert len({*chunk1, *pictures.FORWARD_COLORS, *pictures.BACKWARD_COLORS}) == 6
    # Digits stay readable: dark on the light chunk, light on the dark one.
    first, third = grid[1:px, 1:px], grid[1:px, 2 * px + 1:3 * px]
    assert _ink(first, pictures.TEXT_COLOR).any() and not _ink(first, pictures.LIGHT_TEXT_COLOR).any()
    assert _ink(third, pictures.LIGHT_TEXT_COLOR).any() and not _ink(third, pictures.TEXT_COLOR).any()
    # The legend shows both chunks' shades of both phases.
    below = image[layout.grid_top + 2 * px + 2:]
    for color in (*pictures.FORWARD_COLORS[:1], chunk1[0], pictures.BACKWARD_COLORS[0],
                  pictures.cell_color("B", 0, 1, 2)):
        assert _count_color(below, color) >= 100, color


# --- measured timelines -------------------------------------------------------------------------------------

UNIT = 2.0 ** -7  # seconds; binary-exact, so shifted times and the text header are exact
ORIGIN = 0.25


def _hand_measured():
    """K=2, M=2 fill-drain as a profiler might see it: row 1's two backwards overlap by 2 units, transfers on
    both rows, times starting at ORIGIN."""
    def cell(stage, micro_batch, phase, start, end):
        return timeline.Cell(stage, micro_batch, phase, ORIGIN + start * UNIT, ORIGIN + end * UNIT)

    cells = [cell(0, 0, "F", 0, 10), cell(0, 1, "F", 10, 20), cell(0, None, "T", 20, 23), cell(0, 1, "B", 40, 60),
             cell(0, 0, "B", 60, 80),
             cell(1, 0, "T", 10, 12), cell(1, 0, "F", 12, 22), cell(1, 1, "F", 22, 32), cell(1, 1, "B", 32, 52),
             cell(1, 0, "B", 50, 72), cell(1, None, "T", 72, 80)]
    return timeline.Timeline.measured(order("fill_drain", 2), 2, cells[::-1])


def test_measured_timeline_bubble_counts_compute_and_idle_counts_transfers_too():
    t = _hand_measured()
    assert t.is_measured and t.makespan == 80 * UNIT
    assert [(c.start, c.end) for c in t.stage_cells(0)][:2] == [(0.0, 10 * UNIT), (10 * UNIT, 20 * UNIT)]
    # Compute: row 0 [0, 20] + [40, 80] = 60, row 1 [12, 72] = 60 (the overlap counted once), of 2 x 80.
    assert t.bubble_fraction == pytest.approx(1 - 120 / 160, abs=1e-12)
    # Transfers too: row 0 adds 3, row 1 adds 2 + 8.
    assert t.idle_fraction == pytest.approx(1 - 133 / 160, abs=1e-12)
    assert t.ideal_bubble_fraction() == pytest.approx(1 / 3)


def test_measured_text_in_milliseconds_with_transfers():
    lines = pictures.render_text(_hand_measured()).split("\n")
    assert lines[0] == ("measured: GPipe schedule fill_drain K=2 M=2: step 625 ms, bubble 25.0% (bound 33.3%), idle "
                        "16.9% counting transfers as busy; 1 column = 78.1 ms, n = forward, n' = backward, "
                        "~ = transfer, . = idle")
    # Columns of 10 units, sampled at their middles (5, 15, ...): row 0's transfer (20-23) falls between two.
    assert lines[1] == "stage 0 |0 1 . . 1'1'0'0'|"
    assert lines[2] == "stage 1 |. 0 1 1'1'0'0'~ |"


def test_measured_overlap_never_hides_a_cell():
    # F1 starts while F0 runs and outlasts it: at every middle F0 covers, F1 (started later) is drawn.
    cells = [timeline.Cell(0, 0, "F", 0.0, 0.25), timeline.Cell(0, 1, "F", 0.03125, 0.5),
             timeline.Cell(0, 1, "B", 0.5, 1.0), timeline.Cell(0, 0, "B", 1.0, 1.5),
             timeline.Cell(0, None, "T", 0.125, 0.1875), timeline.Cell(0, 1, "T", 1.3, 1.45)]
    # The transfers overlap compute: drawn under it, busy time counted once.
    t = timeline.Timeline.measured(order("fill_drain", 1), 2, cells)
    assert pictures.render_text(t).split("\n")[1] == "stage 0 |0 1 1'1'0'0'|"
    assert t.bubble_fraction == t.idle_fraction == 0.0


def test_measured_text_shows_every_cell_once_for_each_schedule():
    for t in (predict(3, 4, [1.0, 1.5, 0.7], schedule="one_f_one_b"),
              predict(2, 4, [0.5, 0.6, 0.4, 0.5], schedule="interleaved", virtual_stages=2)):
        # The prediction as a measurement: seconds, with a transfer after every forward.
        cells = [dataclasses.replace(c, start=5 + c.start / 100, end=5 + c.end / 100) for c in t.cells]
        cells += [timeline.Cell(c.stage, c.micro_batch, "T", c.end, c.end + 0.001) for c in cells if c.phase == "F"]
        measured = timeline.Timeline.measured(t.order, t.num_micro_batches, cells)
        assert measured.bubble_fraction == pytest.approx(t.bubble_fraction, abs=1e-9)
        assert measured.idle_fraction < measured.bubble_fraction
        lines = pictures.render_text(measured).split("\n")
        assert lines[0].startswith(f"measured: GPipe schedule {t.schedule_label()} ")
        for row, line in enumerate(lines[1:]):
            body = re.fullmatch(r"(?:stage|device) \d+ \|(.*)\|", line).group(1)
            width = len(str(t.num_micro_batches - 1)) + (1 if t.virtual_stages > 1 else 0) + 1
            runs = [label for label, _ in itertools.groupby(body[j:j + width] for j in range(0, len(body), width))]
            compute = [label for label in runs if label.strip(" ~.")]
            expected = [f"{c.micro_batch}{'ab'[c.lap] if t.virtual_stages > 1 else ''}"
                        f"{' ' if c.phase == 'F' else chr(39)}" for c in t.stage_cells(row)]
            assert compute == expected


@pytest.mark.parametrize("kwargs,names", [
    (dict(cells=[]), "cells=[] is invalid"),
    (dict(cells=[("F", 0)]), "cells[0]=('F', 0) is invalid: it must be a timeline.Cell"),
    (dict(cells=[timeline.Cell(2, 0, "F", 0, 1)]), "cells[0].stage=2 is invalid: it must be an int in [0, 2)"),
    (dict(cells=[timeline.Cell(0, 0, "X", 0, 1)]), "cells[0].phase='X' is invalid: it must be 'F' (forward), "
                                                   "'B' (backward), 'W' (weight gradients) or 'T' (transfer)"),
    (dict(cells=[timeline.Cell(0, None, "B", 0, 1)]), "cells[0].micro_batch=None is invalid: it must be an int in "
                                                      "[0, 4)"),
    (dict(cells=[timeline.Cell(0, 4, "T", 0, 1)]), "cells[0].micro_batch=4 is invalid: it must be an int in [0, 4) "
                                                   "(num_micro_batches=4), or None for a transfer"),
    (dict(cells=[timeline.Cell(0, 0, "F", 0, 1, lap=1)]), "cells[0].lap=1 is invalid: it must be an int in "
                                                            "[0, 1) (virtual_stages=1)"),
    (dict(cells=[timeline.Cell(0, 0, "F", 2.0, 1.0)]), "cells[0].end=1.0 is invalid: it must be a time >= start=2.0"),
    (dict(cells=[timeline.Cell(0, 0, "F", float("nan"), 1.0)]), "cells[0].start=nan is invalid"),
    (dict(cells=[timeline.Cell(0, 0, "F", 1.0, 1.0)]), "cells span 0.0 seconds"),
    (dict(cells=[timeline.Cell(0, 0, "F", 0, 1)], order="gpipe"), "order='gpipe' is invalid: pass the "
                                                                   "ScheduleOrder of the schedule that ran"),
])
def test_invalid_measured_arguments_name_the_value(kwargs, names):
    args = dict(order=order("fill_drain", 2), num_micro_batches=4)
    args.update(kwargs)
    with pytest.raises(ParamsError, match=re.escape(names)):
        timeline.Timeline.measured(**args)


# --- predicted next to measured -----------------------------------------------------------------------------

def test_comparison_text_stacks_both_with_their_headers():
    text = pictures.render_comparison_text(predict(2, 2), _hand_measured())
    predicted, measured = text.split("\n\n")
    assert predicted.split("\n") == ["predicted: " + pictures.render_text(predict(2, 2)).split("\n")[0],
                                     "stage 0 |0 1 . . . 1'1'0'0'|", "stage 1 |. 0 1 1'1'0'0'. . |"]
    assert measured == pictures.render_text(_hand_measured())


def test_comparison_png_has_both_grids_and_one_legend():
    px = 20
    predicted, measured = predict(2, 2), _hand_measured()
    image = _decoded(pictures.render_comparison_png(predicted, measured, cell_px=px))
    top, bottom = pictures.comparison_layout(predicted, measured, cell_px=px)
    assert image.shape == (top.height, top.width, 3) and (top.height, top.width) == (bottom.height, bottom.width)
    assert (top.columns, bottom.columns) == (9, 8)  # 9 forward costs; 80 units in ticks of 10 (the shortest F)
    grids = []
    for layout in (top, bottom):
        grid = image[layout.grid_top:layout.grid_top + 2 * px + 1, layout.grid_left:layout.grid_left +
                     layout.columns * px + 1]
        for edge in (grid[0], grid[-1], grid[:, 0], grid[:, -1]):
            assert _ink(edge, pictures.GRID_COLOR).all()
        grids.append(grid)
    assert bottom.grid_top > top.grid_top + 2 * px + 40  # stacked, with the measured title between

    def color(grid, row, column):
        return tuple(grid[row * px + 3, column * px + 3])

    predicted_grid, measured_grid = grids
    # Predicted: F(0, 0) first on stage 0 while stage 1 idles; B(0, 0) last on stage 0.
    assert color(predicted_grid, 0, 0) == pictures.FORWARD_COLORS[0]
    assert color(predicted_grid, 1, 0) == pictures.IDLE_COLOR
    assert color(predicted_grid, 0, 8) == pictures.BACKWARD_COLORS[0]
    # Measured (the text rows of test_measured_text_in_milliseconds_with_transfers): 0 1 . . 1'1'0'0' and
    # . 0 1 1'1'0'0'~ .
    assert [color(measured_grid, 0, j) for j in range(4)] == [*pictures.FORWARD_COLORS, pictures.IDLE_COLOR,
                                                              pictures.IDLE_COLOR]
    assert color(measured_grid, 1, 3) == pictures.BACKWARD_COLORS[1]
    assert color(measured_grid, 1, 7) == pictures.TRANSFER_COLOR
    dark = np.all(image < 128, axis=-1)
    # Titles above each grid, millisecond labels under the measured one: a mark every 500 ms (the first round
    # step >= 80 pixels; 1 ms is 20 / 78.125 pixels), so at 0 and 128 pixels.
    assert dark[top.grid_top - 40:top.grid_top - 20].any()
    assert dark[top.grid_top + 2 * px + 1:bottom.grid_top - 20].any()
    mark_rows = slice(bottom.grid_top + 2 * px + 1, bottom.grid_top + 2 * px + 5)
    for x in (bottom.grid_left, bottom.grid_left + 128):
        assert _ink(image[mark_rows, x], pictures.TEXT_COLOR).all()
    assert not _ink(image[mark_rows, bottom.grid_left + 64], pictures.TEXT_COLOR).any()
    # One legend, below both grids, with the transfer swatch.
    legend = image[bottom.grid_top + 2 * px + 2:]
    for swatch in (pictures.FORWARD_COLORS[0], pictures.BACKWARD_COLORS[0], pictures.TRANSFER_COLOR):
        assert _count_color(legend, swatch) >= 100
    between = image[top.grid_top + 2 * px + 2:bottom.grid_top]
    assert _count_color(between, pictures.TRANSFER_COLOR) == 0
    tensor = pictures.comparison_image_tensor(predicted, measured, cell_px=px)
    assert tensor.dtype == tf.uint8
    np.testing.assert_array_equal(tensor.numpy()[0], image)


def test_comparison_wants_a_predicted_then_a_measured_timeline():
    predicted, measured = predict(2, 2), _hand_measured()
    with pytest.raises(ParamsError, match="predicted is a measured timeline"):
        pictures.render_comparison_png(measured, measured)
    with pytest.raises(ParamsError, match="measured is a predicted timeline"):
        pictures.render_comparison_text(predicted, predicted)
    with pytest.raises(ParamsError, match="measured=None is invalid"):
        pictures.render_comparison_text(predicted, None)


def test_report_predicts_the_chosen_schedule_from_a_plan():
    costs = (1.0, 3.0, 2.0, 2.0)
    plan = StagePlan(balance=(1, 1, 1, 1), stage_layers=tuple((f"layer_{j}",) for j in range(4)), layer_costs=costs,
                     cost_kind="params", remat=(False, True, False, False), devices=None)
    fill_drain = pipeline_report.predicted_timeline(plan, 4)
    assert (fill_drain.schedule, fill_drain.num_stages) == ("fill_drain", 4)
    t = pipeline_report.predicted_timeline(plan, 4, order("interleaved", 2, v=2))
    assert (t.schedule, t.num_stages, t.virtual_stages) == ("interleaved", 2, 2)
    # Pipeline stage s = chunk * 2 + device keeps the plan's cost (normalized to sum 1) and remat.
    for c in t.cells:
        s = t.chunk(c)
        factor = 1.0 if c.phase == "F" else (3.0 if plan.remat[s] else 2.0)
        assert c.duration == pytest.approx(costs[s] / 8 * factor)
    with pytest.raises(ParamsError, match=r"the interleaved order has 6 chunks \(K=2 x v=3\) but the plan "
                                          r"has 4: plan with virtual_stages=3"):
        pipeline_report.predicted_timeline(plan, 4, order("interleaved", 2, v=3))


def test_backward_costs_replace_the_ratio_per_stage():
    t = predict(2, 2, [1.0, 1.0], schedule="one_f_one_b", backward_costs=[2.0, 5.0])
    assert [c.duration for c in t.stage_cells(1) if c.phase == "B"] == [5.0, 5.0]
    assert [c.duration for c in t.stage_cells(0) if c.phase == "B"] == [2.0, 2.0]
    # F(1,0) ends at 2; B(1,0) 2..7; B(0,0) 7..9; F(1,1) 7..8, B(1,1) 8..13; B(0,1) 13..15.
    assert t.makespan == 15.0
    with pytest.raises(ParamsError, match=r"backward_costs=\[1.0\] has 1 entries .* one backward cost"):
        predict(2, 2, backward_costs=[1.0])


def test_measured_ops_inside_a_span_are_its_compute():
    # A backward whose span holds a gap (its worker waited between its two ops): the gap is idle time.
    cells = [timeline.Cell(0, 0, "F", 0.0, 1.0), timeline.Cell(0, 0, "B", 1.0, 4.0, ops=((1.0, 2.0), (3.0, 4.0)))]
    t = timeline.Timeline.measured(order("fill_drain", 1), 1, cells)
    assert t.bubble_fraction == pytest.approx(0.25)
    assert t.cells[1].compute == 2.0 and t.cells[1].duration == 3.0
    shifted = timeline.Timeline.measured(order("fill_drain", 1), 1,
                                         [dataclasses.replace(c, start=c.start + 5, end=c.end + 5,
                                                              ops=tuple((a + 5, b + 5) for a, b in c.ops))
                                          for c in cells])
    assert shifted.cells[1].ops == ((1.0, 2.0), (3.0, 4.0))
    with pytest.raises(ParamsError, match=re.escape("cells[0].ops=((0.5, 2.0),) is invalid: it must be a list of "
                                                    "(start, end) op intervals inside the cell's [1.0, 4.0]")):
        timeline.Timeline.measured(order("fill_drain", 1), 1, [timeline.Cell(0, 0, "B", 1.0, 4.0, ops=((0.5, 2.0),))])


@pytest.mark.parametrize("k,m,costs", [(2, 4, None), (4, 8, None), (3, 5, [1.0, 2.5, 0.5]), (1, 3, None)])
def test_zero_bubble_runs_weight_gradients_in_the_bubbles(k, m, costs):
    # ZB-H1's order: each backward splits into B (input gradient) and W (weight gradients, half of it here). Every
    # cell runs once, after all its dependencies, as soon as its device is free; W(s, i) after B(s, i) and at most
    # K - s micro-batches behind; the total work is 1F1B's, the makespan shorter wherever there is a bubble.
    zb = predict(k, m, costs, schedule="zero_bubble", defer_weights=True)
    one_f_one_b = predict(k, m, costs, schedule="one_f_one_b")
    keys = sorted((t_.phase, zb.chunk(t_), t_.micro_batch) for t_ in zb.cells)
    assert keys == sorted((p, s, i) for s in range(k) for i in range(m) for p in "FBW")
    cells = {(c.phase, zb.chunk(c), c.micro_batch): c for c in zb.cells}
    for row in range(k):
        free = 0.0
        for c in zb.stage_cells(row):
            needs = zb.order.dependencies(c.phase, c.stage, c.micro_batch, m)
            ready = max([cells[need].end for need in needs], default=0.0)
            assert c.start == pytest.approx(max(free, ready), abs=1e-12), c
            free = c.end
        for i in range(m):
            assert cells["W", row, i].start >= cells["B", row, i].end - 1e-12
            if i >= k - row:
                assert cells["F", row, i].start >= cells["W", row, i - (k - row)].end - 1e-12
    work = sum(c.duration for c in zb.cells)
    assert work == pytest.approx(sum(c.duration for c in one_f_one_b.cells))
    stage_costs = costs or [1.0] * k
    for (phase, s, _), c in cells.items():
        assert c.duration == pytest.approx(stage_costs[s] * (1.0 if phase in "FBW" else 0.0))
    if k > 1:
        assert zb.makespan < one_f_one_b.makespan and zb.bubble_fraction < one_f_one_b.bubble_fraction


def test_zero_bubble_beats_gpipes_bound_at_two_stages_by_hand():
    # K=2, M=4, F = B = W = 1: stage 0 runs W of micro-batch i right after its B (its forwards wait on both), so
    # the drain's idle time shrinks: 14 units against 1F1B's 15, a bubble of 1 - 24/28 = 14.3% under GPipe's 20%.
    t = predict(2, 4, schedule="zero_bubble", defer_weights=True)
    assert t.makespan == pytest.approx(14.0)
    assert t.bubble_fraction == pytest.approx(1 - 24 / 28) and t.ideal_bubble_fraction() == pytest.approx(0.2)
    lines = pictures.render_text(t).split("\n")
    assert lines[0].startswith('GPipe schedule zero_bubble K=2 M=4: bubble 14.3% (bound 20.0%); 1 column = 1, '
                               'n = forward, n\' = backward, n" = weight gradients, . = idle')
    assert lines[1:] == ["stage 0 |0 1 . 0'0\"2 1'1\"3 2'2\". 3'3\"|", "stage 1 |. 0 0'0\"1 1'1\"2 2'2\"3 3'3\". |"]
    # Weight gradients draw in their own color, and the legend names them.
    image = _decoded(pictures.render_png(t, cell_px=20))
    layout = pictures.picture_layout(t, cell_px=20)
    grid = image[layout.grid_top:, layout.grid_left:]
    assert tuple(grid[3, 20 * 4 + 3]) == pictures.cell_color("W", 0)  # stage 0, column 4: W of micro-batch 0
    with pytest.raises(ParamsError, match=r"weight_fraction=1.0 is invalid: it must be in \(0, 1\)"):
        predict(2, 4, schedule="zero_bubble", weight_fraction=1.0)


@pytest.mark.parametrize("schedule", ["zero_bubble", "zero_bubble_v"])
@pytest.mark.parametrize("k,m,costs", [(2, 4, None), (2, 8, None), (3, 5, "random"), (4, 8, "random"), (1, 3, None)])
def test_weight_gradients_per_micro_batch_run_right_after_their_input_gradients(schedule, k, m, costs):
    # As TensorFlow runs the windowed loop (W per micro-batch): W(s, i) starts when B(s, i) ends, and every cell
    # that waits for B(s, i) in the order data waits for W(s, i) too. So a zero-bubble order's step is that of the
    # same order with B and W as one backward cell (no weight window), i.e. 1F1B's for ZB-H1, for any costs.
    v = 2 if schedule == "zero_bubble_v" else 1
    if costs == "random":
        costs = list(np.random.default_rng(k * 10 + m).uniform(0.3, 2.0, k * v))
    t = predict(k, m, costs, schedule=schedule)
    cells = {(c.phase, t.chunk(c), c.micro_batch): c for c in t.cells}
    assert sorted(cells) == sorted((p, s, i) for s in range(k * v) for i in range(m) for p in "FBW")
    for (phase, s, i), c in cells.items():
        if phase == "W":
            assert c.start == pytest.approx(cells["B", s, i].end, abs=1e-12), c
        for need in t.order.dependencies(phase, s, i, m):
            if need[0] == "B" and phase != "W":
                assert c.start >= cells[("W",) + need[1:]].end - 1e-12, (c, need)
    whole = timeline.predict(dataclasses.replace(t.order, weight_window=None), m, costs)
    assert t.makespan == pytest.approx(whole.makespan, rel=1e-12)
    assert t.bubble_fraction == pytest.approx(whole.bubble_fraction, abs=1e-12)
    if schedule == "zero_bubble":
        assert t.makespan == pytest.approx(predict(k, m, costs, schedule="one_f_one_b").makespan, rel=1e-12)
    if k > 1:  # the same work either way; where W waits for the bubbles, the step is shorter
        deferred = predict(k, m, costs, schedule=schedule, defer_weights=True)
        assert deferred.makespan < t.makespan


def test_weight_gradients_with_their_input_gradients_by_hand():
    # ZB-V's windows alone (without the V's backward waits), K=2, M=4, F = 1, B + W = 2 per chunk: W runs right
    # after B, so device 1 (stages 1 and 2, the turn of the V) and device 0 (stages 0 and 3) pass B+W along as one
    # backward: a makespan of 28 for 24 units of work on two devices, a bubble of 1 - 24/28 = 14.3%, above the
    # bound for two chunks (11.1%); with W deferred into the bubbles it is 25 (4.0%).
    windows_only = dataclasses.replace(orders.zero_bubble_v(2), backward_waits=())
    t = timeline.predict(windows_only, 4)
    assert t.makespan == pytest.approx(28.0) and t.bubble_fraction == pytest.approx(1 - 24 / 28)
    assert timeline.predict(windows_only, 4, defer_weights=True).bubble_fraction == pytest.approx(1 / 25)
    # With them the step is one unit longer (29): device 0 starts micro-batch 2 only after its last chunk's
    # backward of micro-batch 0, the price of holding 2K half-stages per device (next test).
    assert predict(2, 4, schedule="zero_bubble_v").makespan == pytest.approx(29.0)
    assert predict(2, 4, schedule="zero_bubble_v", defer_weights=True).bubble_fraction == pytest.approx(1 / 25)
    with pytest.raises(ParamsError, match=re.escape("defer_weights='yes' is invalid: it must be True (W where the "
                                                    "order allows it) or False (W right after its B, as TensorFlow "
                                                    "runs it)")):
        predict(2, 4, schedule="zero_bubble_v", defer_weights="yes")
