"""InfiniteBench's prompt templates and generation lengths, transcribed from OpenBMB/InfiniteBench
`src/prompt.py` and `src/eval_utils.py` (Copyright (c) 2023 OpenBMB, MIT License).

Two template families, `task.template`:

- ``yarn_mistral`` (the default): the templates InfiniteBench runs its open models with
  (YaRN-Mistral-7B, Yi-6B/34B-200K, ChatGLM3-6B-128K, `MODEL_TO_PROMPT_TEMPLATE`); they end where
  the answer starts ("The pass key is").
- ``gpt4``: the GPT-4 templates (instructions after the context, "Be very concise."). InfiniteBench
  runs GPT-4's math_calc as the bare expression after a system message and a worked example turn
  (`create_msgs`); here math_calc takes the template its `prompt.py` lists for it.

Every template holds ``{context}`` once: the text before it and the record's context are the
prompt's context part, the text after it the question.
"""

from __future__ import annotations

TASKS = (
    "passkey",
    "number_string",
    "kv_retrieval",
    "longbook_sum_eng",
    "longbook_choice_eng",
    "longbook_qa_eng",
    "longbook_qa_chn",
    "longdialogue_qa_eng",
    "math_find",
    "math_calc",
    "code_run",
    "code_debug",
)

# `DATA_NAME_TO_MAX_NEW_TOKENS`
MAX_NEW_TOKENS = {
    "passkey": 6,
    "number_string": 12,
    "kv_retrieval": 50,
    "longbook_sum_eng": 1200,
    "longbook_choice_eng": 40,
    "longbook_qa_eng": 40,
    "longbook_qa_chn": 40,
    "longdialogue_qa_eng": 40,
    "math_find": 3,
    "math_calc": 30000,
    "code_run": 5,
    "code_debug": 5,
}

_NEEDLE = "There is an important info hidden inside a lot of irrelevant text. Find it"
_MASK = (
    'Below is a dialogue script where one random occurrence of a character name is replaced with "$$MASK$$", '
    "and you should try to guess who that character is."
)
_OPTIONS = "A. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}"

YARN_MISTRAL = {
    "passkey": _NEEDLE + " and memorize it. I will quiz you about the important information.\n\n"
    "{context}\n\n{input}\n\nThe pass key is",
    "number_string": _NEEDLE + ". I will quiz you about the important information there.\n\n"
    "{context}\n\n{input}\n\nThe sequence of digits is",
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n"
    "{context}\n\n{input}",
    "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n"
    + _OPTIONS
    + "\n\nThe letter of the correct answer is",
    "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n"
    "{context}\n\nQuestion: {question}\nAnswer:",
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Let us calculate the intermediate values of an expression.\n\n"
    "Expression: 1 + 3 + 4\nValues: [1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\n"
    "Expression: {context}\nValues:",
    "code_run": "There is a function called {func} in the following Python code.\n\n{context}\n\n"
    "Please compute the exact value of {func_call}. The value of {func_call} is",
    "code_debug": "Following is a Python code where exactly one of the functions/methods has a deliberate "
    "error that makes it crash.\n\n{context}\n\nOptions:\n" + _OPTIONS + "\n\nThe correct option is:",
    "longdialogue_qa_eng": _MASK + "\n\n{context}\n\nThe name that has been replaced with $$MASK$$ is likely",
}

GPT4 = {
    "passkey": _NEEDLE + " and memorize them. I will quiz you about the important information there.\n\n"
    "{context}\n\n{input}",
    "number_string": _NEEDLE + ". I will quiz you about the important information there.\n\n"
    "{context}\n\n{input}",
    "kv_retrieval": YARN_MISTRAL["kv_retrieval"],
    "longbook_qa_eng": "Read the book below and answer a question.\n\n{context}\n\nQuestion: {question}\n\n"
    "Be very concise.",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n\n"
    "Only one of the following options is correct, tell me the answer using one single letter "
    "(A, B, C, or D). Don't say anything else.\n" + _OPTIONS,
    "longbook_sum_eng": "Summarize the following book.\n\n{context}",
    "longbook_qa_chn": "请根据以下书籍回答我的问题。\n\n{context}\n\n问题：{question}\n请尽量简短地回答。",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Compute the intermediate values in the following long expression.\n\n{context}",
    "code_run": "Following is a set of Python functions. There is a function called named {func}.\n\n"
    "{context}\n\nPlease give me the exact number of the return value of {func_call}. Be concise. "
    "Your response must end with the final returned value.",
    "code_debug": "There is ONLY ONE function in the large project that is deliberately made to include an "
    "obvious error. Please find the function that contains the most obvious errors. I will give you four "
    "options to narrow your scope. You can inspect the options and think. Eventually, tell me the answer "
    "using one single letter (A, B, C, or D).\n\n{context}\n\nWhich funtion has deliberate error?\n"
    + _OPTIONS
    + "\n\nYou should first find the functions in the options. Repeat their content, inspect through code, "
    "and at last give me your answer for the function that has the deliberate and obvious error in "
    "A, B, C, or D.",
    "longdialogue_qa_eng": _MASK + "\n\nThe dialogue:\n\n---\n\n{context}\n\n---\n\nEnd of dialogue.\n\n"
    'Which character is most likely "$$MASK$$"? Just say the name used by the scriptwriter (before the '
    "colon marks) of one single character and nothing else.",
}

TEMPLATES = {"yarn_mistral": YARN_MISTRAL, "gpt4": GPT4}
