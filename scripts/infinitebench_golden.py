"""Score InfiniteBench's published predictions with InfiniteBench's own code: writes
tests/data/infinitebench_scores.json.

    pip install rouge-score==0.1.2   # what evaluate's rouge runs (only this script needs it)
    python scripts/infinitebench_golden.py /path/to/InfiniteBench   # a checkout of OpenBMB/InfiniteBench

Takes predictions and labels from the checkout's `results/<model>/preds_<task>.jsonl` (the
predictions behind the README's table), a few per model and task (the first ones, then the first
right and wrong ones after them) plus the hand-written cases below, and scores each with
`src/compute_scores.py`'s `get_score_one`. The module is loaded from the checkout with what it
imports at module level and the scorers never call stubbed (its argument parser; tqdm where it is not installed);
`evaluate.load("rouge")` would fetch the metric's script from the Hub: it is replaced by that
script's `_compute` restated (huggingface/evaluate `metrics/rouge/rouge.py`: Google's rouge_score,
no stemmer, a list of references scored by `score_multi`). math_calc is scored under a model name
other than "gpt4" (the original drops GPT-4's first number; `eval.tasks.infinitebench.metrics`
never does), and its long predictions and labels are cut to their first 400 characters / 60
values before scoring. `tests/test_infinitebench.py` checks that `eval.tasks.infinitebench` gives
every case the same score.

With ``--means`` it also prints, per model and task, the mean score x 100 over each whole published
file from the original's scorer and from `eval.tasks.infinitebench.metrics` (the numbers of the
README's table; docs/tasks.md says where they differ).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "infinitebench_scores.json"
sys.path.insert(0, str(OUT.parents[2]))

from eval.tasks.infinitebench.prompts import TASKS  # noqa: E402  (the tasks in the original's order)

MODELS = ("gpt4", "yarn-mistral", "claude2", "kimi")
FIRST, RIGHT, WRONG = 4, 2, 2  # cases per model and task
SUMMARIES = 2  # longbook_sum_eng: the first two per model (each pair is ~6 KB of text)
HAND: list[tuple[str, object, list[str]]] = [
    ("passkey", ["71432"], ["71432", "The pass key is 71432.", "7143", "no key", "-71432"]),
    ("kv_retrieval", "5e6b7b90-710d", ['"5e6b7b90-710d"', "value: 5e6b7b90-710d.", "5e6b7b90-710dX"]),
    ("longbook_choice_eng", ["Paris", "C"], ["C", "Paris", "The answer is: C", "answer is Paris", "B. Rome"]),
    (
        "code_debug",
        ["repack_carchive", "B"],
        ["B.", "B: it", "The answer is: B", "answer is: repack_carchive"],
    ),
    ("code_debug", ["Configer._set_option", "C"], ["Option C", "correct option is: C", "is:", "A. x"]),
    ("longdialogue_qa_eng", ["ACE", "ACE ROTHSTEIN"], ["Ace.", "ACE ROTHSTEIN", "GRACE", "it's ace!"]),
    ("longbook_qa_eng", ["fighting in world war 1", "the war"], ["He died in the war.", "War", ""]),
    ("longbook_qa_chn", ["胡一刀，马行空"], ["胡一刀", "马行空，胡一刀。", "无"]),
    ("math_find", [88], ["88", "it is 88 ", "The answer is 87", "none"]),
    ("math_find", [2.5], ["2.5", "2.50", "2", "x"]),
    ("math_calc", [[3, 5, -1, 7]], ["[3, 5, -1, 7]", "3, 5, 1, 7", "3 5 2 7", "5, 3"]),
    ("code_run", [4], ["4", "The value is: 4.", "4.5", "-4", "", "`4`"]),
    ("code_run", [-12], ["-12", "The return value is -12", "12"]),
    ("longbook_sum_eng", ["The war ends.\nAce goes home."], ["Ace goes home after the war ends.", ""]),
]


def load_scorer(repo: Path) -> types.ModuleType:
    from rouge_score import rouge_scorer

    class Rouge:  # evaluate's rouge metric, `_compute` with use_stemmer=False, one score per prediction
        def compute(self, predictions, references, use_aggregator=True):
            scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)
            out = []
            for ref, pred in zip(references, predictions):
                s = scorer.score_multi(ref, pred) if isinstance(ref, list) else scorer.score(ref, pred)
                out.append(s["rougeLsum"].fmeasure)
            return {"rougeLsum": out}

    sys.modules["evaluate"] = types.SimpleNamespace(load=lambda name: Rouge())
    sys.modules["args"] = types.SimpleNamespace(parse_args=None)
    try:
        import tqdm  # noqa: F401  (the module imports it; the harness has it)
    except ImportError:
        sys.modules["tqdm"] = types.SimpleNamespace(tqdm=lambda x: x)
    module = types.ModuleType("infinitebench_compute_scores")
    source = (repo / "src" / "compute_scores.py").read_text(encoding="utf-8")
    exec(compile(source, "compute_scores.py", "exec"), module.__dict__)
    return module


def means(repo: Path, cs: types.ModuleType) -> None:
    from eval.tasks.infinitebench.metrics import score as ours

    for model in sorted(p.name for p in (repo / "results").iterdir() if p.is_dir()):
        cells = []
        for task in TASKS:
            path = repo / "results" / model / f"preds_{task}.jsonl"
            try:
                rows = list(cs.iter_jsonl(path)) if path.is_file() else []
            except ValueError:
                rows = []
            if not rows:
                cells.append(f"{task} -")
                continue
            labels, preds = cs.get_labels(rows), cs.get_preds(rows, task)
            theirs = [cs.get_score_one(p, lab, task, model) for p, lab in zip(preds, labels)]
            mine = [ours(task, p, lab) for p, lab in zip(preds, labels)]
            cells.append(f"{task} {100 * sum(theirs) / len(theirs):.2f}/{100 * sum(mine) / len(mine):.2f}")
        print(f"{model}: " + ", ".join(cells), flush=True)


def main(repo: Path, with_means: bool = False) -> None:
    cs = load_scorer(repo)
    if with_means:
        means(repo, cs)

    def score(task: str, pred: str, label: object) -> float:
        return cs.get_score_one(pred, label, task, "infinitebench")

    cases = []
    for task in TASKS:
        for model in MODELS:
            path = repo / "results" / model / f"preds_{task}.jsonl"
            if not path.is_file():
                continue
            try:
                rows = list(cs.iter_jsonl(path))
            except ValueError:  # yarn-mistral's longbook_qa_chn file is not valid JSON lines
                print(f"skipped {path}: not JSON lines")
                continue
            labels, preds = cs.get_labels(rows), cs.get_preds(rows, task)
            if task == "math_calc":
                preds = [p[:400] for p in preds]
                labels = [[lab[0][:60]] if isinstance(lab[0], list) else lab[:60] for lab in labels]
            scored = [(p, lab, score(task, p, lab)) for p, lab in zip(preds, labels)]
            if task == "longbook_sum_eng":
                chosen = scored[:SUMMARIES]
            else:
                chosen = scored[:FIRST]
                chosen += [c for c in scored[FIRST:] if c[2] > 0][:RIGHT]
                chosen += [c for c in scored[FIRST:] if c[2] == 0][:WRONG]
            for pred, label, value in chosen:
                cases.append(
                    {"task": task, "source": model, "label": label, "prediction": pred, "score": value}
                )
    for task, label, preds in HAND:
        for pred in preds:
            cases.append(
                {
                    "task": task,
                    "source": "hand",
                    "label": label,
                    "prediction": pred,
                    "score": score(task, pred, label),
                }
            )
    OUT.write_text(
        "[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]\n", encoding="utf-8"
    )
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--means"]
    if len(args) != 1:
        sys.exit("usage: python scripts/infinitebench_golden.py [--means] /path/to/InfiniteBench")
    main(Path(args[0]), "--means" in sys.argv[1:])
