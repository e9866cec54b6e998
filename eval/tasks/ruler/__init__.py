"""RULER (arXiv 2404.06654): task settings (`config`), the offline generators (`generate`), the
task (`task`) and its report tables and figures (`report`)."""
