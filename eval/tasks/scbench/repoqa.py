"""RepoQA's scorer as SCBench runs it, transcribed from microsoft/MInference
`scbench/repo_qa_utils.py` (Copyright (c) Microsoft Corporation, MIT License; RepoQA, Liu et al.
2024, https://arxiv.org/abs/2406.06025, evalplus/repoqa, Apache-2.0).

A prediction is reduced to one function (`sanitize_output`: the first function definition
tree-sitter finds in the prediction's ``` code blocks, in order; none: the first block; no block:
the whole prediction), then compared with every needle function of the same repository
(`needles`: the reference functions of all the run's questions about that repository) by BLEU
over whitespace tokens (NLTK's `sentence_bleu`, smoothing method 4). The question passes when the
most similar needle (the first one on a tie) is the one asked for and its BLEU is at least 0.8
(SCBench reports pass@1 at threshold 0.8; one sample per question, so pass@1 is the pass rate).
Comments are kept (`ignore_comments=False`, SCBench's default).

tree-sitter grammars come from `tree-sitter-languages` (the `repoqa` extra); `available()` says
whether it is installed.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from typing import Any

THRESHOLD = 0.8
# Tree-sitter queries for one function definition per language (repo_qa_utils.FUNCTION_QUERY).
FUNCTION_QUERY = {
    "python": "(function_definition name: (_)) @fdef",
    "java": "(method_declaration name: (_)) @fdef",
    "typescript": "(function_declaration name: (_)) @fdef",
    "rust": "(function_item name: (_)) @fdef",
    "cpp": "(function_definition declarator: (function_declarator declarator: (identifier))) @fdef",
    "go": "(function_declaration name: (_)) @fdef",
}
CODE_BLOCK = re.compile(r"^```(?:\w+)?\s*\n(.*?)(?=^```)```", re.DOTALL | re.MULTILINE)


def available() -> bool:
    """Whether the tree-sitter grammars RepoQA's scorer parses with are installed."""
    return importlib.util.find_spec("tree_sitter_languages") is not None


def sanitize_output(prediction: str, lang: str) -> str:
    """The function a prediction answers with (module docstring)."""
    from tree_sitter_languages import get_language, get_parser  # lazy: the `repoqa` extra

    prediction = prediction.strip()
    blocks = CODE_BLOCK.findall(prediction)
    if not blocks:
        return prediction
    parser, query = get_parser(lang), get_language(lang).query(FUNCTION_QUERY[lang])
    for block in blocks:
        data = bytes(block, "utf8")
        try:
            for node, _ in query.captures(parser.parse(data).root_node):
                return data[node.start_byte : node.end_byte].decode("utf8")
        except Exception:  # noqa: BLE001 - as RepoQA: a block tree-sitter cannot read is skipped
            pass
    return blocks[0]


def similarity(candidate: str, reference: str) -> float:
    """`compute_function_similarity`: BLEU of the whitespace tokens, smoothing method 4."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    cand, ref = re.split(r"\s+", candidate.strip()), re.split(r"\s+", reference.strip())
    return sentence_bleu([ref], cand, smoothing_function=SmoothingFunction().method4)


def repoqa(prediction: str, label: dict[str, Any]) -> float:
    """1.0 when the needle most similar to the prediction is ``label["name"]`` with BLEU >= 0.8.

    `label`: ``{"name": the asked function, "lang": its language, "needles": [[name, code], ...]}``.
    """
    output = sanitize_output(prediction, label["lang"])
    best_name, best = None, 0.0
    needles: Sequence[Sequence[str]] = label["needles"]
    for name, code in needles:
        current = similarity(output, code)
        if current > best:
            best_name, best = name, current
    return float(best_name == label["name"] and best >= THRESHOLD)
