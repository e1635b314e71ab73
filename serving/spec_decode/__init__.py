"""Speculative decoding: the second half of an engine step when drafts are on (verify, roll back, draft)."""
