"""WHAT comes out: traces, comparisons, reports. Knows nothing of trainers or processes."""
