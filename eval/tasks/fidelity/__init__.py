"""Fidelity to the full cache on any text: a continuation teacher-forced after a compressed context,
scored against the full cache's distributions (KL, top-1 agreement, perplexity). The task (`task`)
and its report (`report`)."""
