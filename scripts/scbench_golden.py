"""Score the SCBench golden cases with SCBench's own code: writes tests/data/scbench_scores.json.

    pip install rouge-score==0.1.2   # what evaluate's rouge runs (only this script needs it)
    python scripts/scbench_golden.py /path/to/MInference   # a checkout of microsoft/MInference

Runs `scbench/compute_scores.py`'s `get_score_one` (under the InfiniteBench task name SCBench maps
each config to, `Multiturnbench_to_Infinitebench`) on labels built by `scbench/eval_utils.py`'s
`get_ground_truth`, for the hand-written predictions below. Both files are loaded from the
checkout; what they import at module level and the scorers never call (the argument parser,
RepoQA's utilities, torch) is stubbed, and only `get_ground_truth` is taken from eval_utils.py.
`evaluate.load("rouge")` would fetch the metric's script from the Hub: it is replaced by that
script's `_compute` restated (huggingface/evaluate `metrics/rouge/rouge.py`: Google's rouge_score,
no stemmer, one F1 per prediction), so the summary cases check the call into rouge_score. `tests/test_scbench.py` checks that `eval.tasks.scbench` gives every case the same
score.
"""

from __future__ import annotations

import ast
import json
import sys
import types
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "scbench_scores.json"

CHOICE = {"options": ["the red house", "a boat", "Paris", "nothing at all"], "answer": "Paris"}
CASES: list[tuple[str, dict, list[str]]] = [
    (
        "scbench_kv",
        {"input": 'Key: "a1"\nThe value associated with the specified key is:', "answer": "9f3e-77ab"},
        ["9f3e-77ab", 'The value is "9f3e-77ab".', "9F3E-77AB", "9f3e-77a", "", "  9f3e-77ab\n"],
    ),
    (
        "scbench_prefix_suffix",
        {"input": "Which string starts with 'abc' and ends with 'xyz'?", "answer": "abcQWExyz"},
        ["abcQWExyz", "It is abcQWExyz.", "abcqwexyz", "abcQWE"],
    ),
    (
        "scbench_vt",
        {
            "input": "Find all variables that are assigned the value 12345.",
            "answer": ["VAR ABCDE", "VAR QWERT", "VAR ZZZZZ"],
        },
        ["VAR ABCDE, VAR QWERT, VAR ZZZZZ", "var abcde and var qwert", "VAR ZZZZZ", "none", ""],
    ),
    (
        "scbench_qa_eng",
        {"input": "Who wrote the letter?", "answer": "Elizabeth Bennet"},
        ["Elizabeth Bennet", "It was elizabeth bennet who wrote it.", "Elizabeth", "Mr. Darcy", ""],
    ),
    (
        "scbench_qa_chn",
        {"input": "谁写了这封信？", "answer": "伊丽莎白"},
        ["伊丽莎白", "是伊丽莎白写的。", "伊丽", "达西先生", "", "Elizabeth 伊丽莎白！"],
    ),
    (
        "scbench_qa_chn",
        {"input": "他们去了哪里？", "answer": ["北京", "北京市"]},
        ["北京", "他们去了北京市。", "上海", ""],
    ),
    (
        "scbench_choice_eng",
        {"input": "Where did they go?", **CHOICE},
        [
            "C",
            "C. Paris",
            "A",
            "Paris",
            "The answer is C",
            "The answer is: Paris",
            "answer is",
            "I think option is C.",
            "Maybe B or C",
            "They went to Paris.",
            "",
            "  D\n",
            "the answer: B",
            "AB",
            "xyz",
        ],
    ),
    (
        "scbench_many_shot",
        {"input": "Q: is the sentence sarcastic?\nA:", "answer": "(A)"},
        ["(A)", "(B)", "A", "b", "no idea", "", "(c"],
    ),
    (
        "scbench_summary",
        {
            "input": "Summarize the paper.",
            "answer": "The paper studies caches.\nIt compresses keys and values.",
        },
        [
            "The paper studies caches.\nIt compresses keys and values.",
            "studies key value caches and compresses them",
            "A paper.",
            "",
            "It compresses keys and values.\nThe paper studies caches.",
            "the the paper paper studies\n\ncaches caches it it compresses values keys and keys",
            "Values, keys: it compresses!\nCaches? The paper studies them; the paper.\nKeys and values again.",
            "THE PAPER-STUDIES caches_2 and 3 values\n\n\n",
        ],
    ),
    (
        "scbench_summary_with_needles",
        {"input": "Summarize it.", "answer": "Cats sleep a lot.", "task": "scbench_summary"},
        ["Cats sleep a lot.", "cats sleep", "Dogs bark.", "a lot of cats\nsleep a lot"],
    ),
    (
        "scbench_summary_with_needles",
        {"input": "What is the pass key?", "answer": "68493", "task": "scbench_passkey"},
        ["68493", "The pass key is 68493.", "684 93", "It is 68492.", "none", "068493"],
    ),
    (
        "scbench_mf",
        {
            "input": "What is the largest number in the list above? The largest number of the list is",
            "answer": 97,
        },
        ["97", "The answer is 97.", "97.9", "-97", "9 7", "no number", "097", "98"],
    ),
]

F_ADD = "def add(a, b):\n    total = a + b\n    return total"
F_SCALE = "def scale(values, factor):\n    out = []\n    for v in values:\n        out.append(v * factor)\n    return out"
F_NAME = "def full_name(first, last):\n    name = first + ' ' + last\n    return name.strip()"
REPOQA = {
    "context": "# repo files\n" + "\n\n".join([F_ADD, F_SCALE, F_NAME]),
    "lang": "python",
    "repo": "example/calc",
    "multi_turns": [
        {"input": "Function that adds two numbers.", "answer": F_ADD, "name": "add"},
        {"input": "Function that multiplies each value.", "answer": F_SCALE, "name": "scale"},
        {"input": "Function that joins a first and last name.", "answer": F_NAME, "name": "full_name"},
    ],
}
# One prediction per turn of REPOQA per set: code blocks, prose around them, two functions in a
# block (the first is taken), another function, a near copy, no block, nothing.
REPOQA_PREDICTIONS = [
    [f"```python\n{F_ADD}\n```", f"Here it is:\n```python\n{F_SCALE}\n```\nDone.", F_NAME],
    [f"```python\n{F_SCALE}\n```", f"```\n{F_ADD}\n\n{F_SCALE}\n```", ""],
    [
        "```python\ndef add(x, y):\n    total = x + y\n    return total\n```",
        f"```python\nimport os\n\n{F_SCALE}\n```",
        "```python\ndef full_name(first, last):\n    return first\n```",
    ],
]

# compute_scores.Multiturnbench_to_Infinitebench, restated to pick the task name per config.
TASK_NAMES = {
    "scbench_kv": "kv_retrieval",
    "scbench_prefix_suffix": "kv_retrieval",
    "scbench_vt": "scbench_vt",
    "scbench_qa_eng": "longdialogue_qa_eng",
    "scbench_qa_chn": "longbook_qa_chn",
    "scbench_choice_eng": "longbook_choice_eng",
    "scbench_many_shot": "scbench_many_shot",
    "scbench_mf": "math_find",
    "scbench_summary": "scbench_summary",
    # scbench_summary_with_needles: per turn task, as compute_scores' subtasks.
    "scbench_passkey": "passkey",
}


class Rouge:
    """evaluate's rouge metric, `_compute` restated (the module docstring)."""

    def compute(self, predictions, references, use_aggregator=True, use_stemmer=False):
        from rouge_score import rouge_scorer

        assert not use_aggregator, "SCBench asks for one score per prediction"
        scorer = rouge_scorer.RougeScorer(
            ["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=use_stemmer
        )
        multi = isinstance(references[0], list)
        scores = [
            scorer.score_multi(r, p) if multi else scorer.score(r, p) for r, p in zip(references, predictions)
        ]
        return {key: [s[key].fmeasure for s in scores] for key in scores[0]}


def load(minference: Path):
    src = minference / "scbench"
    sys.path.insert(0, str(src))  # repo_qa_utils, the real one
    for name in ("evaluate", "args", "tempdir"):
        stub = types.ModuleType(name)
        stub.load = lambda *a, **k: Rouge()  # evaluate.load("rouge")
        stub.parse_args = lambda: None
        sys.modules[name] = stub
    scores = types.ModuleType("scbench_compute_scores")
    exec(
        compile((src / "compute_scores.py").read_text(), str(src / "compute_scores.py"), "exec"),
        scores.__dict__,
    )
    tree = ast.parse((src / "eval_utils.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_ground_truth")
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src / "eval_utils.py"), "exec"), ns)
    return scores.get_score_one, ns["get_ground_truth"], scores.compute_repoqa_score


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    get_score_one, get_ground_truth, compute_repoqa_score = load(Path(sys.argv[1]))
    rows = []
    for config, turn, predictions in CASES:
        (label,) = get_ground_truth({"multi_turns": [turn]}, config)
        for prediction in predictions:
            task_name = TASK_NAMES[turn.get("task", config)]
            score = get_score_one(prediction, label, task_name, "model")
            rows.append({"config": config, "turn": turn, "prediction": prediction, "score": score})
    for predictions in REPOQA_PREDICTIONS:  # SCBench's compute_scores for scbench_repoqa
        gts = get_ground_truth(REPOQA, "scbench_repoqa")
        preds = [
            {
                "lang": REPOQA["lang"],
                "repo": REPOQA["repo"],
                "prediction": p,
                "ground_truth": gt,
                "func_name": t["name"],
            }
            for p, gt, t in zip(predictions, gts, REPOQA["multi_turns"])
        ]
        needles = {REPOQA["repo"]: [{"needle": p["ground_truth"], "name": p["func_name"]} for p in preds]}
        out = compute_repoqa_score("model", preds, gts, needles)["model"]["results"]["python"]
        for t, (p, res) in enumerate(zip(predictions, out)):
            passed = res["is_best_similar"] and res["best_similar_score"] >= 0.8  # pass@1 at 0.8
            rows.append(
                {
                    "config": "scbench_repoqa",
                    "record": REPOQA,
                    "turn_index": t,
                    "prediction": p,
                    "score": float(passed),
                }
            )
    lines = ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows)  # one case per line
    OUT.write_text(f"[\n{lines}\n]\n", encoding="utf-8")
    print(f"{len(rows)} cases -> {OUT}")


if __name__ == "__main__":
    main()
