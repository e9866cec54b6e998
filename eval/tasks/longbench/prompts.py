"""LongBench configuration: the 16 English datasets, prompt templates, generation lengths, model lengths.

Ported, unchanged, from:
- LongBench (THUDM, MIT licence, https://github.com/THUDM/LongBench, Bai et al. 2023,
  https://arxiv.org/abs/2308.14508): `config/dataset2prompt.json` and `config/dataset2maxlen.json`,
  restricted to the 16 English datasets. The templates keep LongBench's typos ("asconcisely") and
  spacing on purpose: scores are only comparable with the exact prompts.
- SnapKV (FasterDecoding, https://github.com/FasterDecoding/SnapKV,
  `experiments/LongBench/config/`), which copies those files and adds `model2maxlen.json`: the
  maximum prompt length in tokens per model, prompts longer than that are truncated in the middle.

`tests/test_longbench_task.py` checks these dicts against the original JSON files when they are
available. Edit them only to follow an upstream change.
"""

from __future__ import annotations

# The 16 English datasets SnapKV reports, in LongBench's order (3,750 samples in all).
DATASETS: tuple[str, ...] = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)

# Datasets LongBench feeds WITHOUT the chat template (few-shot / code-completion prompts: chat models
# do better on them as raw text, pred.py's comment). For trec, triviaqa and samsum only the first line
# of the prediction is scored (that rule lives in eval/tasks/longbench/metrics.py).
NO_CHAT_TEMPLATE: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lcc", "repobench-p"})

# Prompt template per dataset: `template.format(**record)` with `{context}` and `{input}`.
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n"
        "\n"
        "Story: {context}\n"
        "\n"
        "Now, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n"
        "\n"
        "Question: {input}\n"
        "\n"
        "Answer:"
    ),
    "qasper": (
        'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n'
        "\n"
        "Article: {context}\n"
        "\n"
        ' Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n'
        "\n"
        "Question: {input}\n"
        "\n"
        "Answer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n"
        "\n"
        "{context}\n"
        "\n"
        "Now, answer the following question based on the above text, only give me the answer and do not output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n"
        "\n"
        "The following are given passages.\n"
        "{context}\n"
        "\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n"
        "\n"
        "The following are given passages.\n"
        "{context}\n"
        "\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n"
        "\n"
        "The following are given passages.\n"
        "{context}\n"
        "\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n"
        "\n"
        "Report:\n"
        "{context}\n"
        "\n"
        "Now, write a one-page summary of the report.\n"
        "\n"
        "Summary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n"
        "\n"
        "Transcript:\n"
        "{context}\n"
        "\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n"
        "\n"
        "Query: {input}\n"
        "Answer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n"
        "\n"
        "News:\n"
        "{context}\n"
        "\n"
        "Now, write a one-page summary of all the news.\n"
        "\n"
        "Summary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n"
        "\n"
        "{context}\n"
        "{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n"
        "\n"
        "{context}\n"
        "\n"
        "{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n"
        "\n"
        "{context}\n"
        "\n"
        "{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n"
        "\n"
        "{context}\n"
        "\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n"
        "\n"
        "The final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n"
        "\n"
        "{context}\n"
        "\n"
        "The following is an abstract.\n"
        "\n"
        "{input}\n"
        "\n"
        'Please enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n'
        "\n"
        "The answer is: "
    ),
    "lcc": ("Please complete the code given below. \n{context}Next line of code:\n"),
    "repobench-p": ("Please complete the code given below. \n{context}{input}Next line of code:\n"),
}

# Maximum number of new tokens generated per dataset.
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# SnapKV's maximum prompt length (tokens) per model, keyed by LongBench's model names.
MODEL2MAXLEN: dict[str, int] = {
    "llama2-7b-chat-4k": 3500,
    "longchat-v1.5-7b-32k": 31500,
    "xgen-7b-8k": 7500,
    "internlm-7b-8k": 7500,
    "chatglm2-6b": 31500,
    "chatglm2-6b-32k": 31500,
    "chatglm3-6b-32k": 31500,
    "vicuna-v1.5-7b-16k": 15500,
    "mistral-7B-instruct-v0.2": 31500,
    "mistral-7B-instruct-v0.1": 31500,
    "mixtral-8x7B-instruct-v0.1": 31500,
    "llama-2-7B-32k-instruct": 31500,
    "lwm-text-chat-1m": 1048576,
    "lwm-text-1m": 1048576,
}


def model_max_length(model_name: str) -> int:
    """SnapKV's max prompt length (tokens) for a LongBench model name, e.g. "mistral-7B-instruct-v0.2"."""
    try:
        return MODEL2MAXLEN[model_name]
    except KeyError:
        raise ValueError(
            f"unknown LongBench model name {model_name!r}; known: {sorted(MODEL2MAXLEN)}. "
            "For other models pass task.max_prompt_tokens=<int> (context length minus generation room)."
        ) from None
