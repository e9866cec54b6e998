"""Needle-in-a-haystack: a fact hidden at a depth of a long context, asked for after it. The task
(`task`, several keyed needles: `multi`) and its report (`report`)."""
