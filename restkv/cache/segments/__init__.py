"""What a compressed layer holds, one file per segment kind: exact tokens (dense or ragged), quantised
codes, pruned keys, and the summaries and corrections parts make of what they evict."""
