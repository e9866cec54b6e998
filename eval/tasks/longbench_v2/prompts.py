"""LongBench-v2's zero-shot prompts and generation length.

Transcribed from THUDM/LongBench (branch main, MIT licence, Copyright (c) 2023 THU-KEG & Zhipu AI,
https://github.com/THUDM/LongBench): `prompts/0shot.txt` and `pred.py` (Bai et al. 2024,
https://arxiv.org/abs/2412.15204). The data, THUDM/LongBench-v2 on the Hub, is Apache-2.0. The
texts keep the files' exact bytes (no trailing newline); scores are only comparable with the exact
prompts. Edit them only to follow an upstream change.
"""

from __future__ import annotations

# prompts/0shot.txt: pred.py fills $DOC$ (the context, stripped), $Q$ (the question, stripped) and
# $C_A$ .. $C_D$ (the choices, stripped), in that order, each with str.replace over the whole text.
TEMPLATE_0SHOT = (
    "Please read the following text and answer the question below.\n"
    "\n"
    "<text>\n"
    "$DOC$\n"
    "</text>\n"
    "\n"
    "What is the correct answer to this question: $Q$\n"
    "Choices:\n"
    "(A) $C_A$\n"
    "(B) $C_B$\n"
    "(C) $C_C$\n"
    "(D) $C_D$\n"
    "\n"
    'Format your response as follows: "The correct answer is (insert answer here)".'
)

# pred.py's max_new_tokens without CoT.
MAX_NEW_TOKENS = 128

CHOICES = ("A", "B", "C", "D")
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")
