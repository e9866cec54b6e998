"""The speed benchmark: paired, interleaved timings of prefill and decoding (`run`), one
configuration's measurement (`measure`), the reference clock (`clock`), the summary and plots
(`report`), the PyTorch-ops floor of H2O's scoring (`floor`) and a paired A/B of two configs
(`pair`). Neither the runner nor the report imports this package."""
