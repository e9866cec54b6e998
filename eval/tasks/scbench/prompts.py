"""SCBench's prompts and generation lengths, transcribed from microsoft/MInference `scbench/eval_utils.py`
(Copyright (c) Microsoft Corporation, MIT License; SCBench, Li et al. 2024,
https://arxiv.org/abs/2412.10319).

SCBench renders one context and several turns (`multi_turns`) per record. Its multi-request mode
(`create_scdq_prompt`) prefixes the context with an instruction (`CONTEXT_TEMPLATES`, the context
part) and asks each turn as its own user text (`QUERY_TEMPLATES`, the template its multi-turn mode
uses for a later turn inside the chat template, `multiturn_follow_up_templates_in_chat_tempate`);
its multi-turn mode's first turn is the context part, a blank line and the first query
(`multiturn_templates`). Here every question is asked that way: ``context part + "\\n\\n" + query``
as one prompt, and the query alone as a later chat turn (`Sample.turn`). The wording is SCBench's,
typos included ("The the correct answer is").
"""

from __future__ import annotations

# The configs of the Hub dataset microsoft/SCBench, in its README's order.
CONFIGS: tuple[str, ...] = (
    "scbench_kv",
    "scbench_prefix_suffix",
    "scbench_vt",
    "scbench_repoqa",
    "scbench_qa_eng",
    "scbench_qa_chn",
    "scbench_choice_eng",
    "scbench_many_shot",
    "scbench_summary",
    "scbench_mf",
    "scbench_summary_with_needles",
    "scbench_repoqa_and_kv",
)
# Configs whose scorer needs the `repoqa` extra (tree-sitter grammars).
NEEDS_REPOQA: tuple[str, ...] = ("scbench_repoqa", "scbench_repoqa_and_kv")
# What `task=scbench` runs unless `task.configs` says otherwise: every config but those.
DEFAULT: tuple[str, ...] = tuple(c for c in CONFIGS if c not in NEEDS_REPOQA)

# DATA_NAME_TO_MAX_NEW_TOKENS: per config, or per turn `task` for a config that mixes two.
MAX_NEW_TOKENS: dict[str, int | dict[str, int]] = {
    "scbench_kv": 150,
    "scbench_prefix_suffix": 150,
    "scbench_vt": 30,
    "scbench_qa_eng": 40,
    "scbench_qa_chn": 40,
    "scbench_choice_eng": 40,
    "scbench_many_shot": 10,
    "scbench_mf": 5,
    "scbench_summary": 200,
    "scbench_summary_with_needles": {"scbench_summary": 800, "scbench_passkey": 15},
    "scbench_repoqa": 1024,
    "scbench_repoqa_and_kv": {"scbench_repoqa": 1024, "scbench_kv": 80},
}
# SCBench's multi-turn mode appends this after the generation prompt of scbench_summary's later
# turns (an answer prefix; not in its multi-request mode).
SUMMARY_PREFIX = "This paper"

KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."
BOOK_INSTRUCTION = "Read the book and answer the question."

# multiturn_templates_scdq: the context part (the first element where SCBench splits it in two).
CONTEXT_TEMPLATES: dict[str, str] = {
    "scbench_kv": KV_INSTRUCTION + "\n\n{context}",
    "scbench_prefix_suffix": "{context}",
    "scbench_vt": "{context}",
    "scbench_qa_eng": BOOK_INSTRUCTION + " Be very concise in your answer.\n\n{context}",
    "scbench_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}",
    "scbench_choice_eng": BOOK_INSTRUCTION + "\n\n{context}",
    "scbench_many_shot": "{context}",
    "scbench_summary": "{context}",
    "scbench_summary_with_needles": "{context}",
    "scbench_repoqa": (
        "Based on the function description and code context, please retrieve and repeat the exact "
        "described function from the code context in a code block wrapped by ```:\n\n{context}"
    ),
    "scbench_repoqa_and_kv": "{context}",
    # {prefix}: "What is <target>?" of the record's FIRST turn (`mf_prefix`).
    "scbench_mf": "{prefix}\n\n{context}",
}

# multiturn_follow_up_templates_in_chat_tempate: one turn's query.
QUERY_TEMPLATES: dict[str, str] = {
    "scbench_kv": "{input}",
    "scbench_prefix_suffix": "{input}",
    "scbench_vt": "{input}",
    "scbench_qa_eng": "Question: {question}\nAnswer:",
    "scbench_qa_chn": "问题：{question}\n答案：",
    "scbench_choice_eng": (
        "Question: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\n"
        "The the correct answer is"
    ),
    "scbench_many_shot": "{input}",
    "scbench_summary": "{input}",
    "scbench_summary_with_needles": "{input}",
    "scbench_repoqa": "{input}",
    "scbench_repoqa_and_kv": "{input}",
    # {prefix}: "What is <target>?" of this turn.
    "scbench_mf": "{prefix}\n\n{input}",
}
# Between the context part and a query asked in the same prompt (`multiturn_templates`' first turn).
SEPARATOR = "\n\n"
