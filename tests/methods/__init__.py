"""Each method against a naive transcription of its original code, one file per method.

The transcriptions re-write the originals' definitions with Python loops (no code copied); each
file names the repository (and, where recorded, the commit) it follows. AdaKV's window votes and per-head counts are
shared with CriticalKV and live in tests/reference.py beside SnapKV's and H2O's, which
tests/test_core.py compares (SnapKV's GQA order: KVCache-Factory's kv-head mode and AdaKV's
gqa_support, `test_snapkv_selection_equals_naive_reference`). The ValueError each bad parameter
raises is tabled in test_validation.py."""
