"""Self-distilled data: the target answers prompts (generate), the answers and hidden states land in a store
(store), and the answers' token statistics choose an EAGLE-3 draft vocabulary (vocab)."""
