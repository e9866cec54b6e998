"""Analyses behind the paper's figures and our ablations, built from stored rows or small
dedicated runs: observation-window agreement (`observation`), which positions a method keeps
(`kept_positions`), and the digits ablation figures (`digits`)."""
