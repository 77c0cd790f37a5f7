"""The stage plan is the one source of a pipeline's split and remat decisions.

`--mode=inspect`, the trainer's partition report and the built GPipe layer must show the same balance and per-stage
remat for every registered experiment; an explicit balance needs no layer costs; bad settings name the value and
the fix; the per-stage remat decision follows the policy's definition.
"""

import dataclasses
import re

import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf import experiment, inspection, model_registry
from gpipe_tf.gpipe import placement, remat
from gpipe_tf.gpipe.interleaved import Interleaved
from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.plan import StagePlan, TimingRequiredError, make_plan
from gpipe_tf.gpipe.schedules import step_order
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.layers.base_layer import BaseLayer
from gpipe_tf.layers.linear import Linear
from gpipe_tf.training import pipeline_report

# Pipelines up to this size are built in the test (a few seconds at most); larger ones are checked from Params.
CHEAP_PARAMS = 5_000_000
DEVICES = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]

# One row of the partition table: stage, "layer_a .. layer_b (n)" or "layer_a", params, remat.
ROW = re.compile(r"^\s*(\d+)\s+layer_(\d+)(?: \.\. layer_(\d+) \((\d+)\))?\s+[\d,]+\s+(yes|no)\s")


class StubWriter:
    """Stands in for the TensorBoard writer: the report's text goes to files too, which the test reads."""

    def text(self, step, name, text):
        pass

    def image(self, step, name, image):
        pass


def table_plan(text):
    """(balance, remat) read back from the partition table the trainer writes."""
    balance, flags = [], []
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            first, last = int(match.group(2)), int(match.group(3) or match.group(2))
            balance.append(last - first + 1)
            flags.append(match.group(5) == "yes")
    return tuple(balance), tuple(flags)


def timeline_remat(timeline):
    """Per-stage remat as the predicted timeline shows it: backward = 2 x forward, plus 1 x with recomputation."""
    cells = [(timeline.cell(s, 0, "F").duration, timeline.cell(s, 0, "B").duration)
             for s in range(timeline.num_stages)]
    return tuple(backward > 2.5 * forward for forward, backward in cells)


def expected_remat(policy, k):
    """The policies as documented, written out by hand: the reference the plan is checked against."""
    return {"never": (False,) * k, "always": (True,) * k, "except_last": (True,) * (k - 1) + (False,)}[policy]


@pytest.mark.parametrize("key", model_registry.list_models())
def test_inspect_report_and_gpipe_use_one_plan(key, tmp_path):
    params, _ = experiment.resolve_params(key)
    report = inspection.inspect(params)
    pipelines = inspection.find_pipelines(params.task)
    if not pipelines:
        assert report["pipeline"] is None and report["stages"] == []
        return
    path, p = pipelines[0]
    plan = make_plan(p, num_replicas=None, measure=None, path=path)
    assert plan.remat == expected_remat(p.remat, p.num_stages)
    # inspect shows the plan.
    assert report["balance"] == list(plan.balance) and report["cost_kind"] == plan.cost_kind
    assert [tuple(s["layers"]) for s in report["stages"]] == list(plan.stage_layers)
    assert tuple(s["remat"] for s in report["stages"]) == plan.remat
    # The report's predicted timeline recomputes exactly on the plan's stages.
    assert timeline_remat(pipeline_report.predicted_timeline(plan, p.num_micro_batches)) == plan.remat
    if inspection.count_params(p) > CHEAP_PARAMS:
        return  # paper scale: not built here; GPipe and the report read the same make_plan output
    pipe = p.instantiate()
    assert dataclasses.replace(pipe.plan, devices=None) == plan
    assert pipe.balance == list(plan.balance)
    pipeline_report.write(pipe, str(tmp_path), StubWriter(), 0, lambda line: None)
    assert table_plan((tmp_path / "partition.txt").read_text()) == (plan.balance, plan.remat)


class Opaque(BaseLayer):
    """A layer that cannot count its parameters or flops from Params: only building it tells."""

    def __init__(self, params, parent_path=""):
        super().__init__(params, parent_path)
        self.create_variable("w", [3, 3])

    def fprop(self, theta, inputs, ctx):
        return tf.matmul(inputs, theta["w"])


def test_explicit_balance_needs_no_layer_costs():
    layers = [Opaque.params() for _ in range(3)]
    with pytest.raises(ParamsError, match=r"layer 0 \(Opaque\) cannot count its parameters"):
        GPipe.params().set(layers=layers, num_stages=2, devices=DEVICES[:2]).instantiate()  # balance_by='params'
    pipe = GPipe.params().set(name="net", layers=layers, num_stages=2, num_micro_batches=2, balance=[1, 2],
                              devices=DEVICES[:2]).instantiate()
    assert pipe.plan.balance == (1, 2) and pipe.plan.stage_layers == (("layer_0",), ("layer_1", "layer_2"))
    assert pipe.plan.layer_costs is None and pipe.plan.cost_kind is None and pipe.plan.stage_costs() is None
    assert "cost(none)" in pipe.partition_table()
    # It runs: the pipeline's output is the product of the three weight matrices, computed here with NumPy.
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    reference = x
    for j in range(3):
        reference = reference @ pipe.children[f"layer_{j}"].vars["w"].numpy()
    np.testing.assert_allclose(pipe(tf.constant(x)).numpy(), reference, rtol=1e-5)
    # inspect shows the same split, with "-" for the parameters it cannot count.
    root = Params()
    root.define("model", "test.opaque", "")
    root.define("task", pipe.p, "")
    report = inspection.inspect(root)
    assert report["balance"] == [1, 2] and [s["params"] for s in report["stages"]] == [None, None]
    assert "explicit balance" in inspection.format_report(report)


def linear_layers(n=3):
    return [Linear.params().set(input_dim=4, output_dim=4) for _ in range(n)]


@pytest.mark.parametrize("balance,problem", [
    ([1, 3], "its entries sum to 4"),
    ([0, 3], "stage 0 has 0 layers (every stage needs at least one)"),
    ([1, 1, 1], "it has 3 entries"),
    ([1.5, 1.5], "it must be a list of whole numbers"),
    (3, "it must be a list of whole numbers"),
])
def test_bad_balance_names_the_value_the_rule_and_the_fix(balance, problem):
    p = GPipe.params().set(name="net", layers=linear_layers(), num_stages=2, balance=balance)
    with pytest.raises(ParamsError) as error:
        make_plan(p, num_replicas=None)
    message = str(error.value)
    assert f"net.balance={balance!r}" in message
    assert "must have num_stages=2 positive entries summing to the number of layers (3)" in message
    assert problem in message
    assert "use e.g. balance=[2, 1], or balance=None to balance by balance_by='params'" in message
    # The layer raises the same error, with its path.
    with pytest.raises(ParamsError, match=re.escape(problem)):
        p.copy().set(devices=DEVICES[:2]).instantiate()


@pytest.mark.parametrize("setting,expected", [
    (dict(balance_by="memory"), "net.balance_by='memory' is not one of ('params', 'flops', 'time'); use one of"),
    (dict(remat="sometimes"), "net.remat='sometimes' is not one of ('never', 'always', 'except_last'); use one of"),
    (dict(balance_by="flops"), "net: balance_by='flops' needs micro_batch_shape"),
    (dict(balance_by="time"), "net: balance_by='time' needs micro_batch_shape"),
    (dict(num_stages=4), "net.num_stages=4 must be between 1 and the number of layers (3); use num_stages <= 3"),
    (dict(devices=DEVICES), "net.devices=[" + ", ".join(repr(d) for d in DEVICES) + "] must hold one device per "
                            "stage (2)"),
])
def test_bad_settings_name_value_allowed_values_and_fix(setting, expected):
    p = GPipe.params().set(name="net", layers=linear_layers(), num_stages=2).set(**setting)
    with pytest.raises(ParamsError) as error:
        make_plan(p, measure=lambda layers, spec: [1.0] * len(layers))
    assert expected in str(error.value)


def plan_of(layers, num_stages, schedule):
    p = GPipe.params().set(name="net", layers=linear_layers(layers), num_stages=num_stages, schedule=schedule)
    return make_plan(p, chunk_devices=step_order(schedule, num_stages).devices_by_chunk, num_replicas=None)


@pytest.mark.parametrize("layers,num_stages,v,expected,fixes", [
    # issue 35 item 11: 2 layers under virtual_stages=3 advised "use num_stages <= 0".
    (2, 2, 3, "net.num_stages=2 x schedule.virtual_stages=3 = 6 chunks must be between 1 and the number of layers "
              "(2); 2 layers are too few for 3 chunks per device: use a schedule with one chunk per device "
              "('fill_drain' or 'one_f_one_b') and num_stages <= 2", [(2, "fill_drain"), (2, "one_f_one_b")]),
    (8, 4, 3, "net.num_stages=4 x schedule.virtual_stages=3 = 12 chunks must be between 1 and the number of layers "
              "(8); use num_stages <= 2 or schedule.virtual_stages <= 2", [(2, 3), (4, 2)]),
    (3, 1, 4, "net.num_stages=1 x schedule.virtual_stages=4 = 4 chunks must be between 1 and the number of layers "
              "(3); use schedule.virtual_stages <= 3", [(1, 3)]),
    (3, 2, 2, "net.num_stages=2 x schedule.virtual_stages=2 = 4 chunks must be between 1 and the number of layers "
              "(3); use num_stages <= 1", [(1, 2)]),
    (3, 2, "zero_bubble_v", "net.num_stages=2 x 2 chunks per device = 4 chunks must be between 1 and the number of "
                            "layers (3); use num_stages <= 1", [(1, "zero_bubble_v")]),
])
def test_too_few_layers_for_the_chunks_advises_a_setting_that_plans(layers, num_stages, v, expected, fixes):
    def schedule(value):
        return Interleaved.params().set(virtual_stages=value) if isinstance(value, int) else value

    with pytest.raises(ParamsError) as error:
        plan_of(layers, num_stages, schedule(v))
    assert str(error.value) == expected
    for k, fix in fixes:  # each advised setting plans, and one more stage (or virtual stage) does not
        assert plan_of(layers, k, schedule(fix)).num_chunks <= layers
        more_k, more_fix = (k, fix + 1) if k == num_stages and isinstance(fix, int) else (k + 1, fix)
        with pytest.raises(ParamsError):
            plan_of(layers, more_k, schedule(more_fix))


def test_micro_batch_shape_is_not_needed_with_an_explicit_balance():
    p = GPipe.params().set(layers=linear_layers(), num_stages=2, balance=[2, 1], balance_by="flops")
    assert make_plan(p, num_replicas=None).balance == (2, 1)


@pytest.mark.parametrize("policy", remat.POLICIES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_stage_remat_follows_the_policy(policy, k):
    p = GPipe.params().set(layers=linear_layers(), num_stages=k, remat=policy)
    plan = make_plan(p, num_replicas=None)
    assert plan.remat == expected_remat(policy, k)
    assert plan.remat == tuple(remat.stage_uses_remat(policy, s, k) for s in range(k))


def test_costs_and_balance_follow_the_cost_kind():
    dims = [4, 64, 4, 64, 4]  # params 320, 260, 320, 260; flops for batch 8: 4096 each
    layers = [Linear.params().set(input_dim=a, output_dim=b) for a, b in zip(dims[:-1], dims[1:])]
    p = GPipe.params().set(layers=layers, num_stages=2, micro_batch_shape=[8, 4])
    by_params = make_plan(p, num_replicas=None)
    assert by_params.cost_kind == "params" and by_params.layer_costs == (320.0, 260.0, 320.0, 260.0)
    assert by_params.balance == (2, 2) and by_params.stage_costs() == (580.0, 580.0)
    by_flops = make_plan(p.copy().set(balance_by="flops"), num_replicas=None)
    assert by_flops.cost_kind == "flops" and by_flops.layer_costs == (2 * 8 * 4 * 64, 2 * 8 * 64 * 4) * 2
    # An input spec given directly replaces micro_batch_shape.
    no_shape = p.copy().set(balance_by="flops", micro_batch_shape=None)
    assert make_plan(no_shape, input_spec=tf.TensorSpec([8, 4]), num_replicas=None) == by_flops
    # 'time' balances by what the timer measured.
    timed = make_plan(p.copy().set(balance_by="time"), num_replicas=None,
                      measure=lambda layers, spec: [9.0, 1.0, 1.0, 1.0])
    assert timed.cost_kind == "time" and timed.balance == (1, 3)


def test_time_balance_is_refused_where_nothing_may_be_built():
    p = GPipe.params().set(name="net", layers=linear_layers(4), num_stages=2, balance_by="time",
                           micro_batch_shape=[8, 4])
    with pytest.raises(TimingRequiredError, match="net: balance_by='time' balances by timing each layer"):
        make_plan(p, measure=None)
    root = Params()
    root.define("model", "test.timed", "")
    root.define("task", p, "")
    report = inspection.inspect(root)
    assert report["stages"] == [] and report["balance"] is None
    assert "balance_by='time' balances by timing each layer" in report["note"]
    assert "Give an explicit balance, or use balance_by='params' or 'flops'" in inspection.format_report(report)
    # With an explicit balance nothing needs timing, so inspect shows it.
    report = inspection.inspect(root.copy().set(task=p.copy().set(balance=[1, 3])))
    assert report["balance"] == [1, 3] and report["note"] is None


def test_devices_come_from_the_placement_mapping():
    p = GPipe.params().set(layers=linear_layers(), num_stages=2, device_kind="cpu")
    assert make_plan(p).devices == tuple(tuple(d) for d in placement.replica_stage_devices(1, 2, "cpu"))
    assert make_plan(p, num_replicas=2).devices == tuple(tuple(d) for d in placement.replica_stage_devices(2, 2, "cpu"))
    assert make_plan(p, num_replicas=None).devices is None
    explicit = p.copy().set(devices=[DEVICES[:2], DEVICES[1:]])
    assert make_plan(explicit, num_replicas=2).devices == (tuple(DEVICES[:2]), tuple(DEVICES[1:]))


def test_chunks_go_to_the_devices_the_order_names():
    # Four chunks on two devices, as a V (0, 1, 1, 0) and round robin (0, 1, 0, 1): each replica's chunk c on its
    # device chunk_devices[c]; a map that does not give each device the same number of chunks is refused.
    p = GPipe.params().set(layers=linear_layers(4), num_stages=2, devices=[DEVICES[:2], DEVICES[1:]])
    for chunk_devices in ((0, 1, 1, 0), (0, 1, 0, 1)):
        plan = make_plan(p, chunk_devices=chunk_devices, num_replicas=2)
        assert (plan.num_chunks, plan.num_devices, plan.chunk_devices) == (4, 2, chunk_devices)
        assert plan.devices == tuple(tuple(replica[d] for d in chunk_devices)
                                     for replica in (DEVICES[:2], DEVICES[1:]))
    assert make_plan(p.copy().set(devices=None), num_replicas=None).chunk_devices == (0, 1)
    with pytest.raises(ParamsError, match=re.escape("chunk_devices=[0, 1, 1] must name each of the num_stages=2 "
                                                    "devices (0 .. num_stages-1) equally often")):
        make_plan(p, chunk_devices=(0, 1, 1), num_replicas=None)


def test_inspect_names_k_devices_and_the_chunks_each_holds():
    # K is the devices, not the chunks: Interleaved and ZeroBubbleV put 2 chunks on each of K=2 devices.
    p = GPipe.params().set(layers=linear_layers(4), num_stages=2, num_micro_batches=2, balance_by="params")
    root = Params()
    root.define("model", "test.chunks", "")
    root.define("task", p, "")
    for schedule, devices in (("zero_bubble_v", "0 1 1 0"), ("interleaved", "0 1 0 1")):
        text = inspection.format_report(inspection.inspect(root.copy().set(task=p.copy().set(schedule=schedule))))
        assert f"pipeline task: K=2 x 2 chunks per device (chunk devices {devices}) M=2" in text, text
    text = inspection.format_report(inspection.inspect(root))
    assert "pipeline task: K=2 M=2" in text, text


def test_plan_is_frozen():
    plan = make_plan(GPipe.params().set(layers=linear_layers(), num_stages=2), num_replicas=None)
    assert isinstance(plan, StagePlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.balance = (3,)
