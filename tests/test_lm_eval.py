"""lm-evaluation-harness tasks (evaluation/lm_eval_tasks.py, evaluate_lm.py) against lm-eval's own HFLM: the in-loop
scores of a checkpoint equal lm_eval's on its export (the same accuracy, each request's log-likelihood within 1e-6 of
its size in fp32: LOG_LIKELIHOOD) on 1 process, 2 stages x 2 data-parallel and (tests/test_tensor_parallel.py) 2
stages x tensor parallel 2; the rows and the chunked scores equal HFLM's where requests are cut to the length; bad
tasks are one line before anything starts. The tasks are the demo's (scripts/make_demo_tasks.py): multiple choice
with 2-4 ragged choices, log-likelihood with an empty context, rolling log-likelihood."""
import json
import os
import re

import pytest
import torch

from models.context_parallel import NO_CONTEXT_PARALLEL
from models import IGNORE_INDEX
from models.loss import ContinuationScores, continuation_scores
from models.tensor_parallel import NO_TENSOR_PARALLEL
from tests.launch import demo_overrides, run_in_process

STEP = 8  # the trained fixtures' last step, where they score the tasks
# A log-likelihood sums a continuation's log-probabilities in float32, computed through other kernels (the pipeline's,
# the chunked head's) than the reference's: they differ by a few ulps of the sum (one ulp is 6e-8 to 1.2e-7 of it;
# seen: 1.8e-7, i.e. 7.6e-6 on sums near -47 and 2.3e-5 near -440), and by a few ulps of each token's log-softmax
# normaliser (~1e-6 at logits of ~10) where the sum is near zero.
LOG_LIKELIHOOD = {"rel": 1e-6, "abs": 1e-6}


def read_samples(run_dir, step, source):
    """{task: [sample]} that the loop (source 'pipeline') or evaluate_lm.py ('hf_export') wrote for a step."""
    sample_dir = os.path.join(run_dir, "lm_eval_samples", f"global_step{step}-{source}")
    return {name[:-len(".jsonl")]: [json.loads(line) for line in open(os.path.join(sample_dir, name))]
            for name in sorted(os.listdir(sample_dir))}


def log_likelihoods(sample):
    """A sample's log-likelihood per request (a rolling request's is a float, the others' (value, is_greedy))."""
    return [response if isinstance(response, float) else response[0] for (response,) in sample["resps"]]


def read_results(run_dir, step, source):
    (record,) = [r for r in map(json.loads, open(os.path.join(run_dir, "lm_eval.jsonl")))
                 if r["step"] == step and r["source"] == source]
    return record


def assert_loop_equals_lm_eval(run_dir, tasks, tmp_path, step=STEP, max_length=64):
    """Export the run's checkpoint of `step`, score it with lm-eval's HFLM (evaluate_lm.py, in this process), and
    compare with what the loop wrote: every request's log-likelihood (a rolling one summed over a whole line) and
    every document's metrics within LOG_LIKELIHOOD, is_greedy identical, the task metrics of the tasks scored whole
    equal."""
    from evaluate_lm import main
    main(["--ckpt_dir", str(run_dir), "--tag", f"global_step{step}", "--tasks", ",".join(tasks.values()),
          "--max_length", str(max_length), "--bootstrap_iters", "0", "--dtype", "float32",
          "--output_dir", str(tmp_path)])
    loop, export = read_samples(run_dir, step, "pipeline"), read_samples(tmp_path, step, "hf_export")
    assert sorted(loop) == sorted(export) == sorted(tasks)
    assert len(loop["demo_cloze"]) == 10 and len(export["demo_cloze"]) == 12  # the loop's limit
    for task, samples in loop.items():
        for ours, theirs in zip(samples, export[task]):
            assert ours["doc_id"] == theirs["doc_id"] and ours["arguments"] == theirs["arguments"]
            for (response,), (reference,) in zip(ours["resps"], theirs["resps"]):
                if task == "demo_lines":  # loglikelihood_rolling: a float
                    assert response == pytest.approx(reference, **LOG_LIKELIHOOD), task
                else:
                    assert response[0] == pytest.approx(reference[0], **LOG_LIKELIHOOD), task
                    assert response[1] == reference[1], task
            metrics = [m for m in ours if m not in ("doc_id", "target", "arguments", "resps")]
            assert metrics and all(ours[m] == pytest.approx(theirs[m], **LOG_LIKELIHOOD) for m in metrics), task
    ours, theirs = read_results(run_dir, step, "pipeline"), read_results(tmp_path, step, "hf_export")
    assert ours["lm_eval/demo_next_words/acc"] == theirs["lm_eval/demo_next_words/acc"]
    for name in ("lm_eval/demo_next_words/perplexity", "lm_eval/demo_lines/word_perplexity",
                 "lm_eval/demo_lines/bits_per_byte"):
        assert ours[name] == pytest.approx(theirs[name], rel=1e-5), name
    logged = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "lm_eval/demo_cloze/acc" in r]
    assert [r["step"] for r in logged] == [step] and logged[0]["lm_eval/demo_cloze/acc"] == ours["lm_eval/demo_cloze/acc"]


@pytest.mark.slow
def test_single_process_scores_equal_lm_eval_on_the_export(single_process_run, demo_tasks, tmp_path):
    assert_loop_equals_lm_eval(single_process_run, demo_tasks, tmp_path)


@pytest.mark.slow
def test_two_stages_by_two_data_parallel_scores_equal_lm_eval_on_the_export(reference_run, demo_tasks, tmp_path):
    assert_loop_equals_lm_eval(reference_run, demo_tasks, tmp_path)


@pytest.mark.parametrize("chunk_tokens", [0, 5], ids=["logits", "chunked"])
def test_continuation_scores_are_log_softmax_sums_and_greedy_flags(chunk_tokens):
    """The chunked head's per-row sums equal torch's log_softmax gathered at the labels and summed (HFLM's), and a
    row is greedy exactly when every labelled token is its position's argmax."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 7, 16), torch.randn(40, 16)
    logits = hidden @ weight.t()
    labels = torch.full((3, 7), IGNORE_INDEX)
    labels[0, 2:5] = torch.randint(0, 40, (3,))
    labels[1, 4:] = logits[1, 4:].argmax(-1)  # the greedy continuation
    labels[2, 6] = logits[2, 6].argmax(-1)
    labels[2, 3] = (logits[2, 3].argmax(-1) + 1) % 40
    outputs = (hidden, weight) if chunk_tokens else logits
    scores = continuation_scores(outputs, labels.reshape(-1), 3, NO_TENSOR_PARALLEL, chunk_tokens)
    log_probs = torch.log_softmax(logits, dim=-1)
    for row in range(3):
        scored = labels[row] != IGNORE_INDEX
        expected = log_probs[row][scored].gather(1, labels[row][scored][:, None]).sum()
        greedy = bool((logits[row][scored].argmax(-1) == labels[row][scored]).all())
        assert scores[row, 0].item() == pytest.approx(expected.item(), **LOG_LIKELIHOOD)
        assert (scores[row, 1].item() == 0) == greedy
    assert [bool(scores[row, 1] == 0) for row in range(3)] == [False, True, False]


def test_rows_cut_to_the_length_score_as_hflm(demo_model, demo_tasks):
    """Requests longer than seq_length: PipelineLM cuts each row as HFLM's max_length does and says how many; its
    rows, collated and scored by ContinuationScores from the transformers model's logits, give HFLM's
    log-likelihoods and is_greedy on every request of the three tasks."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.collator import collate_causal_lm
    from evaluation.lm_eval_tasks import PipelineLM

    max_length = 12  # the longest continuation's tokens: HFLM refuses longer ones
    model = AutoModelForCausalLM.from_pretrained(demo_model["hf"], dtype=torch.float32).eval()

    class TransformersRows(PipelineLM):
        def score_rows(self, rows):
            (input_ids, document_ids, _), labels = collate_causal_lm(rows, max_length, 0)
            with torch.no_grad():
                logits = model(input_ids=input_ids, attention_mask=(document_ids > 0).long()).logits
            return ContinuationScores(NO_TENSOR_PARALLEL, 0, NO_CONTEXT_PARALLEL, max_length)(logits, labels)

    tasks = TaskManager(include_defaults=False).load(list(demo_tasks.values()))
    ours = TransformersRows(AutoTokenizer.from_pretrained(demo_model["hf"]), max_length, engine=True)
    reference = HFLM(pretrained=demo_model["hf"], max_length=max_length, batch_size=4, dtype="float32", device="cpu")
    results = {lm: evaluate(lm, tasks, bootstrap_iters=0, log_samples=True)["samples"] for lm in (ours, reference)}
    assert ours.truncated > 10 and ours.requests > ours.truncated
    for task, samples in results[reference].items():
        for sample, expected in zip(results[ours][task], samples):
            for (response,), (reference_response,) in zip(sample["resps"], expected["resps"]):
                if task == "demo_lines":
                    assert response == pytest.approx(reference_response, **LOG_LIKELIHOOD)
                else:
                    assert response[0] == pytest.approx(reference_response[0], **LOG_LIKELIHOOD)
                    assert response[1] == reference_response[1]


@pytest.mark.parametrize("entry,message", [
    ("missing.yaml", r"eval_tasks: task file missing.yaml does not exist; give an existing task YAML"),
    ("{task: x.yaml, limit: 0}", r"eval_tasks entry \{'task': 'x.yaml', 'limit': 0\}: give a task name"),
])
def test_bad_tasks_are_one_line_before_anything_starts(demo_model, tmp_path, entry, message):
    from errors import ConfigError
    with pytest.raises(ConfigError, match=message):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", eval_tasks=f"[{entry}]"), 2)
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.parametrize("kind,message", [
    ("broken", r"^eval_tasks: task file .*broken.yaml does not load \(.*\); fix it \(lm-eval's task YAML format, "
               r"docs/evaluation.md\)\.$"),
    ("generate", r"^eval_tasks: demo_generate is a generate_until task; the training loop scores log-likelihood and "
                 r"multiple-choice tasks only\. Score it on a checkpoint's export instead: python evaluate_lm.py "
                 r"--ckpt_dir out --tag global_stepN --tasks .*generate.yaml$"),
])
def test_a_task_file_that_does_not_load_or_generates_is_one_line(demo_tasks, tmp_path, kind, message):
    from errors import ConfigError
    from evaluation.eval_task import EvalTask
    from evaluation.lm_eval_tasks import load_tasks
    with open(demo_tasks["demo_next_words"]) as f:
        config = json.load(f)
    (tmp_path / "broken.yaml").write_text("task: demo_broken\n  output_type: [multiple_choice\n")
    (tmp_path / "generate.yaml").write_text(json.dumps(dict(config, task="demo_generate",
                                                            output_type="generate_until")))
    with pytest.raises(ConfigError, match=message):
        load_tasks([EvalTask(demo_tasks["demo_cloze"]), EvalTask(str(tmp_path / f"{kind}.yaml"))], "out")


@pytest.mark.slow  # lm-eval's index of its built-in tasks takes ~15 s to build
def test_an_unknown_task_name_is_one_line(demo_model, tmp_path):
    """Refused without lm-eval's task index: no task YAML of lm-eval's holds the name."""
    from errors import ConfigError
    from evaluation.lm_eval_tasks import names_written_in_no_lm_eval_task
    assert names_written_in_no_lm_eval_task(["hellaswagg", "hellaswag"]) == ["hellaswagg"]
    with pytest.raises(ConfigError, match=r"eval_tasks: 'hellaswagg' is not a task, group or tag of lm-eval 0\.4\.13"):
        run_in_process(demo_overrides(demo_model, tmp_path / "run", eval_tasks="[hellaswagg]"), 2)


def test_requests_longer_than_seq_length_are_counted_before_training(demo_model, demo_tasks, capsys):
    """Contexts cut to seq_length are counted in one line; a continuation longer than it (which HFLM refuses too)
    is an error naming the task."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from errors import ConfigError
    from evaluation.lm_eval_tasks import LmEvalTasks
    tokenizer = AutoTokenizer.from_pretrained(demo_model["hf"])
    cfg = OmegaConf.create({"seq_length": 12, "output_dir": "out", "eval_tasks": [demo_tasks["demo_cloze"]]})
    LmEvalTasks(cfg, tokenizer)
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"eval_tasks: .*demo_cloze.yaml: \d+ of 32 requests are longer than seq_length=12 \+ 1 "
                        r"tokens; their contexts are cut from the left, as lm-eval's HFLM with max_length=12 does "
                        r"\(raise seq_length to score them whole\)", line), line
    cfg.seq_length = 6
    with pytest.raises(ConfigError, match=r"^eval_tasks: .*demo_cloze.yaml: a continuation of \d+ tokens is longer "
                                          r"than seq_length=6; raise seq_length, or drop the task\.$"):
        LmEvalTasks(cfg, tokenizer)


def test_the_export_command_names_a_missing_task_before_exporting(demo_model, tmp_path):
    from evaluate_lm import main
    with pytest.raises(SystemExit, match=r"^evaluate_lm: error: '.*missing.yaml' is neither a task, group or tag of "
                                         r"lm-eval .* nor an existing task YAML file\.$"):
        main(["--ckpt_dir", demo_model["ds"], "--tasks", str(tmp_path / "missing.yaml"), "--output_dir",
              str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
