"""gpipe_tf trainer: train, evaluate or inspect a registered experiment (`trainer.py` and `gpipe-trainer` run this).

  python trainer.py --list_models
  python trainer.py --model=toy.classifier.BlobsMlp --logdir=/tmp/run --max_steps=200
  python trainer.py --model=toy.classifier.BlobsMlp --logdir=/tmp/run --mode=eval
  python trainer.py --model=toy.classifier.BlobsMlp --logdir=/tmp/run --mode=export   # SavedModel for serving
  python trainer.py --model=toy.classifier.BlobsMlp --mode=inspect_params --params=train.learning_rate=0.01

A second run with the same --logdir resumes from its latest checkpoint. Errors a user can fix print one line
and exit with status 2; a training failure (NaN loss, unwritable checkpoint) prints one line and exits with 1;
SIGTERM/SIGINT during training save a checkpoint and exit with 0; SIGINT before the first step (e.g. during the
compile) prints one line and exits with 130, having written no checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from absl import app, flags, logging

# Nothing imported at the top imports TensorFlow: --help and --list_models run without it, and TensorFlow's
# start-up notices stay off the console (tf_startup). Modules that import it are imported inside the functions
# that need them, after tf_startup.start_tensorflow().
from gpipe_tf import errors, experiment, model_registry, tf_startup, workers
from gpipe_tf.errors import ConfigError, TrainingError
from gpipe_tf.hyperparams import Params, ParamsError
from gpipe_tf.memory.sizes import parse_bytes
from gpipe_tf.training import progress, run_lock

# TensorFlow's C++ INFO lines (oneDNN, CPU features) bury the progress lines; warnings and errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# TensorFlow's BFC allocator on CPU: without it (e.g. CPUs without AVX-512, where oneDNN is off) the CPU allocator
# keeps no statistics, get_memory_info raises, and the memory/peak_mb/* summaries would be missing. Must be set
# before TensorFlow starts.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")
# oneDNN kernels on CPU: TensorFlow turns them on by itself only on CPUs with AVX-512, but they shorten a step on
# AVX2-only CPUs too (docs/benchmarks.md#onednn, with the command that measures it). Set before TensorFlow starts;
# TF_ENABLE_ONEDNN_OPTS=0 turns them off.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

if TYPE_CHECKING:  # imports TensorFlow: imported at run time after it starts (see the imports above)
    from gpipe_tf.training.replicas import ReplicaLayout

FLAGS = flags.FLAGS

MODES = ("train", "eval", "train_and_eval", "decode", "export", "inspect", "inspect_params")
# Modes that read one checkpoint: --checkpoint chooses it.
_CHECKPOINT_MODES = ("eval", "decode", "export")

flags.DEFINE_string("model", None, "Registry key of the experiment, e.g. toy.classifier.BlobsMlp, or "
                    "<module path>.<Class> for an experiment in your own package (e.g. mypkg.experiments.MyMlp).")
flags.DEFINE_multi_string("module", [], "Import this module (or every module of this package) of your own "
                          "experiments before --model or --list_models, e.g. --module=mypkg.experiments.")
flags.DEFINE_string("logdir", None, "Run directory: params, checkpoints and TensorBoard events.")
flags.DEFINE_enum("mode", "train", MODES, "What to do.")
flags.DEFINE_integer("max_steps", None, "Train up to this global step (overrides train.max_steps).", lower_bound=1,
                     upper_bound=2 ** 63 - 1)
flags.DEFINE_multi_string("params", [], "Dotted Params overrides, e.g. 'train.learning_rate=0.1,train.seed=3'; "
                          "may be repeated, later flags win.")
flags.DEFINE_multi_string("gin_file", [], "Gin files binding experiment knobs.")
flags.DEFINE_multi_string("gin_param", [], "Gin bindings, e.g. 'BlobsMlp.hidden_dims=(128, 128)'.")
flags.DEFINE_integer("logical_devices", None, "Split the CPU into this many logical devices before TF starts "
                     "(default: the experiment's logical_devices).", lower_bound=1)
flags.DEFINE_bool("list_models", False, "Print every registered experiment key with its one-line description and "
                  "exit.")
flags.DEFINE_bool("eval_once", False, "--mode=eval: evaluate the newest checkpoint once instead of following "
                  "the trainer.")
flags.DEFINE_float("eval_timeout_secs", 3600.0, "--mode=eval: stop following after this long without a new "
                   "checkpoint.", lower_bound=0.0)
flags.DEFINE_string("checkpoint", None, "--mode=eval/decode/export: use this checkpoint (a ckpt-N prefix such as "
                    "LOGDIR/checkpoints/ckpt-200, or a run's logdir for its newest) instead of the newest in --logdir.")
flags.DEFINE_string("export_dir", None, "--mode=export: write the SavedModel here (default LOGDIR/export/<step>).")
flags.DEFINE_bool("quiet", False, "No progress lines (warnings, errors and results still print).")
flags.DEFINE_bool("traceback", False, "An error that ends the run in one line prints Python's traceback before it "
                  "(e.g. of an exception your experiment module raised).")
flags.DEFINE_string("profile_steps", None, "START,END: capture a TF profiler trace of those steps into the logdir "
                    "(TensorBoard's Profile tab; pip install -e '.[profile]').")
flags.DEFINE_bool("json", False, "--mode=inspect: print one JSON object.")
flags.DEFINE_string("device_memory", None, "Memory per device, e.g. 16GiB, 8GB, 512MiB (docs/memory.md). "
                    "--mode=inspect: whether each pipeline device fits and, if not, the smallest change that does; "
                    "training: a warning before the first step when the plan does not fit, and the budget of the "
                    "suggestion printed if a device runs out of memory.")
flags.DEFINE_string("capacity", None, "--mode=inspect with --device_memory: the largest value of this integer "
                    "knob of the experiment (e.g. num_layers, filters) that fits, for K = 1, 2, 4, ... stages.")
flags.DEFINE_integer("capacity_devices", None, "--capacity: the most stages (devices) to try (default: the "
                     "experiment's K).", lower_bound=1)
flags.DEFINE_integer("capacity_step", 1, "--capacity: try multiples of this (e.g. 8 for AmoebaNet's filters, "
                     "whose every cell width must be even).", lower_bound=1)
flags.DEFINE_string("accelerator", None, "--mode=inspect: the predicted step time of every K, M, schedule and remat "
                    "worth trying on this device preset (tpu_v2, tpu_v3, p100, v100, a100, h100; docs/speed.md), which "
                    "fit --device_memory (default: the preset's memory), and the fastest that fits.")
flags.DEFINE_float("accelerator_flops", None, "--mode=inspect: peak FLOP/s of one device (replaces --accelerator's; "
                   "with --accelerator_bandwidth, describes a device no preset names).")
flags.DEFINE_float("accelerator_bandwidth", None, "--mode=inspect: bytes/s between two neighbouring devices "
                   "(replaces --accelerator's).")
flags.DEFINE_integer("accelerator_devices", None, "--accelerator: the devices to plan for; K goes up to it (default: "
                     "the experiment's K).", lower_bound=1)
flags.DEFINE_integer("num_replicas", None, "Data-parallel pipeline replicas in this process (overrides "
                     "train.num_replicas); replica r's stage k runs on device r*K+k.", lower_bound=1)
flags.DEFINE_list("worker_hosts", [], "Multi-worker data parallelism: host:port of every trainer process, the chief "
                  "first (writes TF_CONFIG; or set TF_CONFIG yourself). Each process runs its replicas' pipelines "
                  "and tf.distribute all-reduces gradients across processes.")
flags.DEFINE_integer("task_index", 0, "With --worker_hosts: this process's index in that list (0: the chief).",
                     lower_bound=0)
flags.DEFINE_list("stage_workers", [], "Place pipeline stages on these TF servers (host:port each, "
                  "stage k on /job:worker/replica:0/task:k), for pipelines that span processes or hosts.")
flags.DEFINE_integer("local_stage_workers", None, "Start this many single-thread TF servers on 127.0.0.1 and place "
                     "pipeline stages on them: a faithful CPU simulation of one device per stage.")


def _fail(message: str, status: int = 2) -> None:
    _quiet_exit()
    print(f"trainer.py: error: {message}", file=sys.stderr)
    sys.exit(status)


def _quiet_exit() -> None:
    """Python-side TensorFlow warnings off while the process ends on an error already explained in one line.

    Objects dropped at exit would otherwise log their own consequences of it, e.g. a checkpoint of another model
    logs one line per unrestored value (hundreds for a large model). Errors still show.
    """
    logging.set_verbosity(logging.ERROR)


def _main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; flags look like --model=KEY")
    if not FLAGS.list_models:  # listing imports no TensorFlow
        tf_startup.start_tensorflow()

    model_registry.import_modules(FLAGS.module)
    if FLAGS.list_models:
        described = model_registry.describe_models()
        width = max(len(key) for key, _ in described)
        print("\n".join(f"{key:<{width}}  {text}" for key, text in described))
        return
    if not FLAGS.model:
        _fail("--model is required; run with --list_models to see the registered keys")
    overrides = ",".join(part for part in (
        *FLAGS.params, None if FLAGS.max_steps is None else f"train.max_steps={FLAGS.max_steps}",
        None if FLAGS.num_replicas is None else f"train.num_replicas={FLAGS.num_replicas}") if part)
    resolved = experiment.resolve(FLAGS.model, FLAGS.gin_file, FLAGS.gin_param, overrides)
    params, gin_config = resolved.params, resolved.operative_config
    for note in resolved.notes:  # an override that replaced a class: which fields it reset
        # The inspect modes print their report on stdout (inspect_params: a tree to save as params.txt).
        print(note, flush=True, file=sys.stderr if FLAGS.mode in ("inspect", "inspect_params") else sys.stdout)
    # Resolving Params runs no TensorFlow op, so the CPU can still be split here.
    num_devices = FLAGS.logical_devices or params.logical_devices
    if num_devices:
        from gpipe_tf import devices  # noqa: PLC0415 -- imports TensorFlow: after tf_startup
        devices.split_cpu(num_devices)
    if FLAGS.mode == "inspect_params":
        print(params.to_text())
        return
    if FLAGS.mode == "inspect":
        _inspect(params, overrides)
        return
    if _speed_requested():
        _fail(f"--accelerator, --accelerator_flops and --accelerator_bandwidth plan a run: use them with "
              f"--mode=inspect, not --mode={FLAGS.mode}")
    budget = None if FLAGS.device_memory is None else parse_bytes(FLAGS.device_memory)  # a bad size fails first
    with _out_of_memory_as_one_line(params, budget):
        _run_job(params, resolved, gin_config, budget)


@contextlib.contextmanager
def _out_of_memory_as_one_line(params: Params, budget: int | None) -> Iterator[None]:
    """A device that runs out of memory ends the run with one line (device, stage, predicted peak, the change that
    fits: `memory.out_of_memory`) instead of TensorFlow's traceback; checkpoints already written stay."""
    from gpipe_tf.memory import out_of_memory  # noqa: PLC0415 -- imports TensorFlow: after tf_startup

    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised unless it is (or wraps) TensorFlow's out-of-memory error
        message = out_of_memory.find_message(e)
        if message is None:
            raise
        raise TrainingError(out_of_memory.explain(message, params, budget, FLAGS.device_memory or "")) from e


def _run_job(params: Params, resolved: Any, gin_config: str, budget: int | None) -> None:
    """Every mode that builds the model: train, train_and_eval, eval, export and decode."""
    if not FLAGS.logdir:
        _fail(f"--logdir is required for --mode={FLAGS.mode}")
    if FLAGS.checkpoint and FLAGS.mode not in _CHECKPOINT_MODES:
        _fail(f"--checkpoint is for --mode={'/'.join(_CHECKPOINT_MODES)}, not --mode={FLAGS.mode}; to start "
              "training from another run's checkpoint use --params=train.init_from.checkpoint=PATH")
    if FLAGS.export_dir and FLAGS.mode != "export":
        _fail(f"--export_dir is for --mode=export, not --mode={FLAGS.mode}")

    from gpipe_tf.training import logdir as logdir_lib  # noqa: PLC0415 -- imports TensorFlow: after tf_startup
    from gpipe_tf.training.controller import Controller  # noqa: PLC0415 -- imports TensorFlow: after tf_startup

    # Every mode keeps its run in the logdir: a file there is refused before the model is built, not waited on.
    logdir_lib.check_is_directory(FLAGS.logdir)
    profile = _parse_profile_steps(FLAGS.profile_steps)
    training = FLAGS.mode in ("train", "train_and_eval")
    layout = _replica_layout(params) if training else None
    _connect_stage_workers()
    # Training: everything that can reject the command runs before the logdir is touched, so a rejected command
    # leaves it as it was, and a corrected one is never refused because of it.
    for note in logdir_lib.check_compatible(FLAGS.logdir, params, training=training):
        _print(note)
    if training:
        controller = Controller(params, FLAGS.logdir, log=_print, quiet=FLAGS.quiet, profile_steps=profile,
                                layout=layout, knobs=resolved.knobs)
        controller.prepare_training()
        if layout.is_chief:
            logdir_lib.check_writable(FLAGS.logdir)
            _LOCKS.append(run_lock.LogdirLock(FLAGS.logdir))
            _LOCKS[-1].acquire()
            logdir_lib.check_compatible(FLAGS.logdir, params, training=True)  # again: now no other trainer writes
        controller.restore()  # raises, having written nothing, if checkpoints exist and none restores
        if budget is not None and layout.is_chief:
            from gpipe_tf.memory import out_of_memory  # noqa: PLC0415 -- imports TensorFlow: after tf_startup
            for warning in out_of_memory.plan_warnings(params, budget, FLAGS.device_memory):
                _print(warning)
        if layout.is_chief:
            _LOCKS[-1].record_holder()
            # Before params.txt is replaced: it holds the M the checkpoints were trained with.
            for warning in logdir_lib.resume_warnings(FLAGS.logdir, params, controller.task):
                _print(warning)
            logdir_lib.write_params(FLAGS.logdir, params)
            logdir_lib.write_text(FLAGS.logdir, "operative_config.gin", gin_config)
        controller.train(evaluate_every=params.train.eval_interval_steps if FLAGS.mode == "train_and_eval" else None)
    elif FLAGS.mode == "eval":
        Controller(params, FLAGS.logdir, log=_print, quiet=FLAGS.quiet).evaluate(
            follow=not FLAGS.eval_once, timeout_secs=FLAGS.eval_timeout_secs, chosen=FLAGS.checkpoint)
    elif FLAGS.mode == "export":
        from gpipe_tf.training import exporter  # noqa: PLC0415 -- imports TensorFlow: after tf_startup
        exporter.export(params.task.instantiate(), params, FLAGS.logdir, _print, checkpoint=FLAGS.checkpoint,
                        export_dir=FLAGS.export_dir)
    else:
        from gpipe_tf.training import decoder  # noqa: PLC0415 -- imports TensorFlow: after tf_startup
        decoder.decode(params.task.instantiate(), params, FLAGS.logdir, _print, checkpoint=FLAGS.checkpoint,
                       progress_log=(lambda line: None) if FLAGS.quiet else _print)


def _inspect(params: Params, overrides: str) -> None:
    """--mode=inspect: the report on stdout; progress lines (what is planned, how long it took) on stderr."""
    from gpipe_tf import inspection  # noqa: PLC0415 -- imports TensorFlow: after tf_startup
    from gpipe_tf.capacity import format_capacity  # noqa: PLC0415 -- imports TensorFlow: after tf_startup
    from gpipe_tf.gpipe.pipeline import find_pipelines  # noqa: PLC0415 -- imports TensorFlow: after tf_startup

    budget = None if FLAGS.device_memory is None else parse_bytes(FLAGS.device_memory)  # a bad size fails first
    start = time.perf_counter()
    pipelines = find_pipelines(params.task)
    if not FLAGS.quiet:
        shape = ", ".join(f"{path}: K={p.num_stages} stages over {len(p.layers)} layers, "
                          + (f"balance={list(p.balance)}" if p.balance else f"balance_by={p.balance_by}")
                          for path, p in pipelines) or "no pipeline"
        print(f"inspecting {params.model} from its Params ({shape}) ...", file=sys.stderr, flush=True)
    report = inspection.inspect(params, overrides={"gin_file": FLAGS.gin_file, "gin_param": FLAGS.gin_param,
                                                "params": overrides}, device_memory=budget)
    if FLAGS.capacity:
        report["capacity"] = _capacity(params, overrides, budget, pipelines)
    if _speed_requested():
        report["speed"] = _speed(params, budget, pipelines)
    text = inspection.format_report(report)
    if FLAGS.capacity:
        text += "\n" + format_capacity(params.model, FLAGS.capacity, FLAGS.device_memory, report["capacity"])
    if report.get("speed"):
        from gpipe_tf.speed.search import format_speed_plan  # noqa: PLC0415 -- imports TensorFlow: after tf_startup

        text += "\n" + "\n".join(format_speed_plan(report["speed"]))
    print(json.dumps(report) if FLAGS.json else text, flush=True)
    if not FLAGS.quiet:
        print(f"inspect done in {progress.format_duration(time.perf_counter() - start)}", file=sys.stderr,
              flush=True)


def _capacity(params: Params, overrides: str, budget: int | None, pipelines: list) -> list[dict[str, Any]]:
    """--capacity=KNOB: the largest KNOB that fits --device_memory for each K up to --capacity_devices."""
    from gpipe_tf.capacity import capacity  # noqa: PLC0415 -- imports TensorFlow: after tf_startup

    if budget is None:
        _fail(f"--capacity={FLAGS.capacity} needs --device_memory (the memory of one device), e.g. "
              "--device_memory=16GiB")
    devices = FLAGS.capacity_devices or max([p.num_stages for _, p in pipelines] or [1])
    log = None if FLAGS.quiet else (lambda line: print(f"capacity: {line}", file=sys.stderr, flush=True))
    return capacity(params.model, FLAGS.capacity, budget, devices, gin_bindings=FLAGS.gin_param,
                    overrides=overrides, step=FLAGS.capacity_step, progress=log, gin_files=FLAGS.gin_file)


def _speed_requested() -> bool:
    return FLAGS.accelerator is not None or FLAGS.accelerator_flops is not None or (
        FLAGS.accelerator_bandwidth is not None)


def _speed(params: Params, budget: int | None, pipelines: list) -> dict[str, Any] | None:
    """--accelerator: the speed plan of the first pipeline (docs/speed.md), or None with a note where the
    experiment has no pipeline."""
    from gpipe_tf.memory.head import task_head  # noqa: PLC0415 -- imports TensorFlow: after tf_startup
    from gpipe_tf.speed import accelerators, search  # noqa: PLC0415 -- imports TensorFlow: after tf_startup

    device = accelerators.resolve(FLAGS.accelerator, FLAGS.accelerator_flops, FLAGS.accelerator_bandwidth)
    if not pipelines:
        print(f"--accelerator: {params.model} has no GPipe pipeline, so there is no K, M or schedule to choose",
              file=sys.stderr, flush=True)
        return None
    path, pipe = pipelines[0]
    devices = FLAGS.accelerator_devices or pipe.num_stages
    log = None if FLAGS.quiet else (lambda line: print(f"speed plan: {line}", file=sys.stderr, flush=True))
    return search.speed_plan(pipe, params.train, device, devices, budget, head=task_head(params.task, path),
                             path=path, progress=log)


def _replica_layout(params: Params) -> ReplicaLayout:
    """This process's data-parallel layout: --worker_hosts/TF_CONFIG workers and train.num_replicas here."""
    from gpipe_tf.training import replicas  # noqa: PLC0415 -- imports TensorFlow: after tf_startup

    if FLAGS.worker_hosts:
        replicas.write_tf_config(FLAGS.worker_hosts, FLAGS.task_index)
    if (FLAGS.stage_workers or FLAGS.local_stage_workers) and os.environ.get("TF_CONFIG"):
        _fail("--stage_workers/--local_stage_workers and multi-worker data parallelism (--worker_hosts or "
              "TF_CONFIG) cannot be combined in one process yet; use one of them")
    return replicas.make_layout(params.train.num_replicas)


_STAGE_WORKERS: list[Any] = []
_LOCKS: list[Any] = []  # the logdir lock, held until the process ends


def _connect_stage_workers() -> None:
    """--stage_workers / --local_stage_workers: connect to (or start) TF servers; 'auto' stages go there."""
    if not (FLAGS.stage_workers or FLAGS.local_stage_workers):
        return
    from gpipe_tf.gpipe import placement  # noqa: PLC0415 -- imports TensorFlow: after tf_startup

    if FLAGS.stage_workers and FLAGS.local_stage_workers:
        _fail("give --stage_workers or --local_stage_workers, not both")
    if FLAGS.local_stage_workers:
        if FLAGS.local_stage_workers < 1:
            _fail(f"--local_stage_workers={FLAGS.local_stage_workers} must be >= 1")
        local = workers.LocalWorkers(FLAGS.local_stage_workers).start()
        _STAGE_WORKERS.append(local)  # stopped at exit; the servers also die with this process
        spec = local.spec
    else:
        spec = workers.cluster_spec(FLAGS.stage_workers)
    names = workers.connect(spec)
    placement.set_auto_kind("workers")
    _print(f"pipeline stages on {len(names)} TF servers: {', '.join(spec[workers.JOB])}")


def _print(line: str) -> None:
    print(line, flush=True)


def _parse_profile_steps(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        start, end = (int(x) for x in text.split(","))
    except ValueError:
        start, end = -1, -1
    if not 0 <= start < end:
        _fail(f"--profile_steps={text!r} must be START,END with 0 <= START < END, e.g. --profile_steps=10,15")
    return start, end


def main(argv: list[str]) -> None:
    """absl entry point: runs the chosen mode; user errors become one line on stderr and exit status 2."""
    if not FLAGS["verbosity"].present:
        # TensorFlow's Python INFO logs (checkpoint sharding, ...) would interleave with the progress lines.
        logging.set_verbosity(logging.WARNING)
    user_errors = (ConfigError, ParamsError, model_registry.RegistryError)
    try:
        _main(argv)
    except TrainingError as e:
        _print_traceback(e)
        _fail(" ".join(str(e).split()), status=1)
    except KeyboardInterrupt:
        # SIGINT before the training loop installs its handler (which saves and stops cleanly): while the command
        # is checked, the model built or the step compiled. Nothing of the run was written yet.
        if FLAGS.mode in ("train", "train_and_eval"):
            _fail("interrupted (SIGINT) before the training loop started (while checking the command, building the "
                  "model or compiling the step); no checkpoint was written or changed, run again to go on",
                  status=130)
        _fail(f"interrupted (SIGINT) during --mode={FLAGS.mode}; nothing of the run's checkpoints was changed",
              status=130)
    except Exception as e:  # noqa: BLE001 - re-raised below unless it is (or wraps) an error the user can fix
        # AutoGraph wraps errors raised in code it converted (its StagingError): the original is in the exception's
        # chain. An OSError is a full disk or a permission: fixable by the user too. A tensor used as a Python
        # bool in a layer is one line too (the trainer traces without AutoGraph).
        cause = errors.find_in_chain(e, user_errors) or errors.find_in_chain(e, (OSError,))
        line = " ".join(str(cause).split()) if cause is not None else errors.tensor_as_python_value(e)
        if line is None:
            raise
        _print_traceback(e)
        if isinstance(cause, OSError):
            _fail(f"cannot access {cause.filename or 'a file'}: {cause.strerror or cause}; free disk space or fix the "
                  "permissions, then run again")
        _fail(line)
    finally:
        for local in _STAGE_WORKERS:
            local.stop()


def _print_traceback(error: BaseException) -> None:
    """--traceback: Python's traceback of `error`, and of the errors it came from, before its one-line message."""
    if FLAGS.traceback:
        traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad flag as one `trainer.py: error:` line and exit status 2 (absl: FATAL, 1)."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        _fail(f"{' '.join(str(e).split())}; run with --help to see the flags")
        raise  # unreachable: _fail exits


def _show_flags_in_help() -> None:
    """Makes --help list this module's flags under any entry point.

    absl's --help lists the key flags of the module named by sys.argv[0]: the launcher `trainer.py`, or the
    installed console script's wrapper (`.../bin/gpipe-trainer`); neither defines flags, so --help would list none.
    Declaring this module's flags key flags of sys.argv[0] fixes both.
    """
    own = FLAGS.find_module_defining_flag("model")
    if own != sys.argv[0]:
        for flag in FLAGS.get_key_flags_for_module(own):
            FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def run() -> None:
    """The entry point of `trainer.py` and of the console script `gpipe-trainer`."""
    _show_flags_in_help()
    app.run(main, flags_parser=_parse_flags)

