"""`--mode=decode`: translate each evaluation dataset with the newest (or a chosen) checkpoint and score them.

Writes `logdir/decode_<dataset>/hypotheses.tsv` (source, hypothesis, reference, target language) and TensorBoard
scalars in the same folder: corpus BLEU (sacrebleu, the standard implementation, tokenize '13a'), corpus chrF
(sacrebleu's defaults: character 6-grams, beta 2) and exact match, overall and per target language. chrF stands
beside BLEU because BLEU's geometric mean over 1- to 4-grams is 0 for a corpus of one-word sentences (German or
Finnish numbers are single compound words) however well they are translated; chrF compares character n-grams, so it
means something for them (docs/monitoring.md#tensorboard says which to read when). Read-only with respect to the
trainer's checkpoints.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable

import sacrebleu
import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import Params
from gpipe_tf.training import checkpoints, progress, weight_ema
from gpipe_tf.training.summaries import SummaryWriter


def score(hypotheses: list[str], references: list[str], languages: list[str]) -> dict[str, float]:
    """BLEU and chrF (points, 0-100) and exact match (a fraction of 1), overall and per target language."""
    out = {"bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
           "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
           "exact_match": sum(h == r for h, r in zip(hypotheses, references)) / max(len(references), 1)}
    by_lang: dict[str, list[int]] = collections.defaultdict(list)
    for j, lang in enumerate(languages):
        by_lang[lang].append(j)
    for lang, rows in sorted(by_lang.items()):
        hyps, refs = [hypotheses[j] for j in rows], [references[j] for j in rows]
        out[f"bleu/{lang}"] = sacrebleu.corpus_bleu(hyps, [refs]).score
        out[f"chrf/{lang}"] = sacrebleu.corpus_chrf(hyps, [refs]).score
        out[f"exact_match/{lang}"] = sum(h == r for h, r in zip(hyps, refs)) / len(rows)
    return out


def _translator(task: tf.Module, ep: Params, max_length: int, bos_id: int, eos_id: int) -> Callable:
    """The traced decoding of one batch of a dataset (beam or greedy search, as `ep` says)."""
    return tf.function(lambda batch: task.decode(batch, max_length, beam_size=ep.beam_size,
                                                 length_penalty_alpha=ep.length_penalty_alpha, bos_id=bos_id,
                                                 eos_id=eos_id), autograph=False)


def decode(task: tf.Module, params: Params, logdir: str, log: Callable[[str], None], checkpoint: str | None = None,
           progress_log: Callable[[str], None] | None = None,
           clock: progress.Clock = time.perf_counter) -> dict[str, dict[str, float]]:
    """Decodes every dataset in eval.datasets with `checkpoint` (default: the newest in logdir); returns the scores
    per dataset. `progress_log` (default `log`) gets the progress lines: the batches decoded so far."""
    if not hasattr(task, "decode"):
        raise ConfigError(f"{params.model} has no decode step: --mode=decode is for sequence models "
                          "(translation); use --mode=eval")
    path, step = checkpoints.restore_task(task, logdir, checkpoint, log)
    if path is None:
        log(f"no checkpoint in {checkpoints.checkpoint_dir(logdir)}: decoding with the initial weights")
    else:
        weight_ema.maybe_use_averages(task, params.train, path, log)
    ep = params.eval
    results = {}
    for name in ep.datasets:
        inp = params.input.get(name).instantiate()
        vocab = inp.vocab
        max_length = ep.decode_max_length or inp.p.max_length
        translate = _translator(task, ep, max_length, vocab.bos_id, vocab.eos_id)
        hypotheses = []
        phase = progress.Phase(progress_log or log, f"decode {name} at step {step}", inp.p.num_batches, clock=clock)
        for n, batch in enumerate(inp.dataset(), start=1):
            hypotheses += [vocab.decode(row) for row in translate(batch).numpy().tolist()]
            phase.update(n)
        seconds = phase.finish()
        references = inp.references()[:len(hypotheses)]
        scores = score(hypotheses, [r[1] for r in references], [r[2] for r in references])
        job_dir = os.path.join(logdir, f"decode_{name}")
        writer = SummaryWriter(logdir, f"decode_{name}")
        writer.scalars(step, scores)
        writer.text(step, "samples", "\n".join(f"{src} => {hyp} (reference: {ref})" for (src, ref, _), hyp
                                                in list(zip(references, hypotheses))[:20]))
        writer.close()
        with open(os.path.join(job_dir, "hypotheses.tsv"), "w", encoding="utf-8") as f:
            f.write("source\thypothesis\treference\ttarget_language\n")
            for (src, ref, lang), hyp in zip(references, hypotheses):
                f.write(f"{src}\t{hyp}\t{ref}\t{lang}\n")
        per_lang = " ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in scores.items() if k.startswith("exact_match/"))
        log(f"decode {name} at step {step}: {len(hypotheses)} sentences, BLEU={scores['bleu']:.2f}, "
            f"chrF={scores['chrf']:.2f}, exact match={scores['exact_match']:.3f} ({per_lang}); "
            f"{progress.format_duration(seconds)}")
        results[name] = scores
    return results
