"""One layer's compression: its plan (what competes, the budgets, what is protected), the context every
part reads, the one pipeline (score, allocate, rescore, reserve, select, merge, rewrite keys,
summarise, store), and recompression of a compressed layer (chunked prefill, decode budgets)."""
